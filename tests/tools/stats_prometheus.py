#!/usr/bin/env python3
"""MPLANE_STATS_FORMAT=both: each process's Prometheus text file parses with prometheus_client's
parser (the one Prometheus' Python client ships) and holds the same totals as its JSON file of the
same run.

    stats_prometheus.py DIR     DIR holds mplane-<pid>.json and mplane-<pid>.json.prom pairs
"""
import glob
import json
import os
import sys

from prometheus_client.parser import text_string_to_metric_families

FIELDS = {  # JSON counter -> (metric suffix, direction label or None)
    "tx_bytes": ("bytes_total", "send"),
    "rx_bytes": ("bytes_total", "receive"),
    "tx_msgs": ("messages_total", "send"),
    "rx_msgs": ("messages_total", "receive"),
    "relayed_bytes": ("relayed_bytes_total", None),
    "errors": ("errors_total", None),
}


def fail(msg):
    print("stats-prometheus: FAIL: " + msg)
    sys.exit(1)


def samples(text, path):
    """{(name, frozenset(labels)): value}, every family a counter, every name a Prometheus name."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "counter":
            fail("%s: family %s is a %s, not a counter" % (path, fam.name, fam.type))
        if not fam.name.startswith("mplane_"):
            fail("%s: family %s lacks the mplane_ prefix" % (path, fam.name))
        for s in fam.samples:
            if not s.name.endswith("_total"):
                fail("%s: sample %s of a counter does not end in _total" % (path, s.name))
            key = (s.name, frozenset(s.labels.items()))
            if key in out:
                fail("%s: %s%s twice" % (path, s.name, s.labels))
            out[key] = s.value
    return out


def get(smp, path, name, **labels):
    key = (name, frozenset((k, str(v)) for k, v in labels.items()))
    if key not in smp:
        fail("%s: no sample %s%s" % (path, name, labels))
    return smp[key]


def check_pair(jpath):
    ppath = jpath + ".prom"
    if not os.path.exists(ppath):
        fail("%s has no Prometheus twin %s" % (jpath, ppath))
    with open(jpath) as f:
        js = json.load(f)
    with open(ppath) as f:
        smp = samples(f.read(), ppath)
    pid = str(js["pid"])
    for (name, labels) in smp:
        if dict(labels).get("pid") != pid:
            fail("%s: %s carries pid %s, the JSON says %s" % (ppath, name, dict(labels).get("pid"), pid))
    for what in ("comms_opened", "comms_closed", "reconnects"):
        got = get(smp, ppath, "mplane_%s_total" % what, pid=pid)
        if got != js[what]:
            fail("%s: mplane_%s_total %s, the JSON %s" % (ppath, what, got, js[what]))
    for p in js["planes"]:
        plane = "unknown" if p["plane"] < 0 else str(p["plane"])
        for field, (suffix, direction) in FIELDS.items():
            lab = dict(pid=pid, plane=plane)
            if direction:
                lab["direction"] = direction
            got = get(smp, ppath, "mplane_plane_" + suffix, **lab)
            if got != p[field]:
                fail("%s: plane %s %s is %s in Prometheus, %s in the JSON" % (ppath, plane, field, got, p[field]))
    for c in js["classes"]:
        for field, (suffix, direction) in FIELDS.items():
            lab = dict(pid=pid, **{"class": c["class"], "sl": str(c["sl"])})
            if direction:
                lab["direction"] = direction
            got = get(smp, ppath, "mplane_class_" + suffix, **lab)
            if got != c[field]:
                fail("%s: class %s %s is %s in Prometheus, %s in the JSON" % (ppath, c["class"], field, got, c[field]))
    # planes the JSON leaves out (nothing counted) are left out of Prometheus too: totals agree
    for suffix in ("bytes_total", "messages_total"):
        for direction in ("send", "receive"):
            by_plane = sum(v for (n, l), v in smp.items() if n == "mplane_plane_" + suffix and ("direction", direction) in l)
            by_class = sum(v for (n, l), v in smp.items() if n == "mplane_class_" + suffix and ("direction", direction) in l)
            if by_plane != by_class:
                fail("%s: %s %s: %s summed over planes, %s over classes" % (ppath, suffix, direction, by_plane, by_class))
    return sum(p["tx_bytes"] + p["rx_bytes"] for p in js["planes"])


def main():
    d = sys.argv[1]
    left = glob.glob(os.path.join(d, "*.tmp.*"))
    if left:
        fail("temporary files left behind (a write not renamed into place): %s" % left)
    pairs = sorted(glob.glob(os.path.join(d, "mplane-*.json")))
    if len(pairs) < 2:
        fail("expected a JSON file per process (2), found %s" % pairs)
    moved = sum(check_pair(j) for j in pairs)
    if moved == 0:
        fail("no bytes counted: the run moved nothing?")
    print("stats-prometheus: %d processes, %d bytes counted, Prometheus totals equal the JSON" % (len(pairs), moved))


if __name__ == "__main__":
    main()
