#!/usr/bin/env python3
"""mplane tests: scripts/autotune's nccl-tests parser and table writer, and a whole run on a fake
nccl-tests (fake_nccl_test.py) whose best algorithm/protocol per size is known in advance.

Environment (set by tests/tuner/meson.build): AUTOTUNE (the script), FAKE_NCCL_TEST,
TUNER_TABLE_LINT (the plugin's own table parser as a command), MPLANE_PLUGIN_DIR (build folder).
"""
import csv
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

AUTOTUNE = os.environ["AUTOTUNE"]
FAKE = os.environ["FAKE_NCCL_TEST"]
LINT = os.environ["TUNER_TABLE_LINT"]
PLUGIN_DIR = os.environ["MPLANE_PLUGIN_DIR"]


def load_autotune():
    loader = importlib.machinery.SourceFileLoader("autotune", AUTOTUNE)
    spec = importlib.util.spec_from_loader("autotune", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


at = load_autotune()

# What nccl-tests 2.17+ prints (plain layout), with a size-0 row and N/A in #wrong.
PLAIN = """\
# nccl-tests version 2.17.6 nccl-headers=22809 nccl-library=22809
# Collective test starting: all_reduce_perf
# nThread 1 nGpus 2 minBytes 0 maxBytes 1024 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 0 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  40012 on     node-a device  0 [0000:18:00] NVIDIA H200
#  Rank  1 Group  0 Pid  40012 on     node-a device  1 [0000:2a:00] NVIDIA H200
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)
           0             0     float     sum      -1     0.10    0.00    0.00     N/A     0.09    0.00    0.00     N/A
         512           128     float     sum      -1    10.25    0.05    0.05     N/A    10.01    0.05    0.05     N/A
        1024           256     float     sum      -1    10.50    0.10    0.10       0    1.2e+01    0.09    0.09       2
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.0625
#
# Collective test concluded: all_reduce_perf
"""

# The per-iteration layout (-I 1): 8 numbers per half; an older "Rank" line without Group; two hosts.
PER_ITER = """\
# NCCL version 2.28.9+cuda12.9
#  Rank  0 Pid  1 on hostA device  0 [0x18] NVIDIA H200
#  Rank  1 Pid  2 on hostB device  0 [0x18] NVIDIA H200
#       size         count      type   redop    root     time   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv%     time   algbw   busbw  #wrong    i_min    i_max    i_p99    i_cv%
        4096          1024     float     sum      -1    20.00    0.20    0.21       0    19.00    22.00    21.50     3.10    30.00    0.14    0.15       0    29.00    31.00    30.90     1.00
"""


class ParseNcclTests(unittest.TestCase):
    def test_plain_layout(self):
        p = at.parse_nccl_tests(PLAIN)
        self.assertEqual(sorted(p["rows"]), [512, 1024])  # size 0 dropped
        self.assertEqual(p["rows"][512]["oop"], {"time": 10.25, "algbw": 0.05, "busbw": 0.05, "wrong": None})
        self.assertEqual(p["rows"][1024]["ip"]["time"], 12.0)
        self.assertEqual(p["rows"][1024]["ip"]["wrong"], 2.0)
        self.assertEqual(p["ranks"], 2)
        self.assertEqual(p["hosts"], ["node-a"])
        self.assertEqual(p["nccl"], "2.28.9")
        self.assertEqual(p["avg_busbw"], 0.0625)
        self.assertEqual(p["errors"], [])

    def test_per_iteration_layout_and_hosts(self):
        p = at.parse_nccl_tests(PER_ITER)
        self.assertEqual(p["rows"][4096]["oop"]["time"], 20.0)
        self.assertEqual(p["rows"][4096]["ip"]["time"], 30.0)  # not i_min of the first half
        self.assertEqual(p["rows"][4096]["ip"]["busbw"], 0.15)
        self.assertEqual(p["ranks"], 2)
        self.assertEqual(p["hosts"], ["hostA", "hostB"])
        self.assertEqual(p["nccl"], "2.28.9+cuda12.9")

    def test_failure_output(self):
        text = ("node-a:123:123 [0] NCCL WARN Error : no algorithm/protocol available for function AllGather\n"
                "node-a: Test NCCL failure all_gather.cu:50 'invalid usage'\n")
        p = at.parse_nccl_tests(text)
        self.assertEqual(p["rows"], {})
        self.assertEqual(len(p["errors"]), 2)

    def test_sizes(self):
        self.assertEqual(at.parse_size("8"), 8)
        self.assertEqual(at.parse_size("64K"), 65536)
        self.assertEqual(at.parse_size("1G"), 1 << 30)
        self.assertEqual(at.parse_size("2m"), 2 << 20)
        with self.assertRaises(ValueError):
            at.parse_size("1.5G")
        self.assertEqual(at.fmt_size(3 << 20), "3 MiB")
        self.assertEqual(at.fmt_size(1000), "1000 B")


def run_of(times):
    """A parsed run with the given {size: time_us} (same in both halves)."""
    return {"rows": {s: {"oop": {"time": t, "busbw": s / t / 1e3, "algbw": 0, "wrong": 0},
                         "ip": {"time": t, "busbw": s / t / 1e3, "algbw": 0, "wrong": 0}} for s, t in times.items()},
            "ranks": 8, "hosts": ["h"], "nccl": "2.28.9", "errors": []}


class TableWriter(unittest.TestCase):
    def test_bucket_bounds(self):
        self.assertEqual(at.bucket_bounds([1024, 4096, 16384]), [(0, 2048), (2049, 8192), (8193, -1)])
        self.assertEqual(at.bucket_bounds([8]), [(0, -1)])

    def test_choose_needs_a_gain_in_both_halves(self):
        sizes = [1024, 4096, 16384, 65536]
        results = {"all_reduce": {
            at.DEFAULT: run_of({1024: 10.0, 4096: 12.0, 16384: 20.0, 65536: 40.0}),
            "Ring/LL": run_of({1024: 8.0, 4096: 9.0, 16384: 25.0, 65536: 80.0}),
            "Ring/LL128": run_of({1024: 9.0, 4096: 10.0, 16384: 19.7, 65536: 30.0}),
            "NVLS/Simple": None,  # could not run
        }}
        # One half faster, the other not: no row.
        results["all_reduce"]["Ring/LL128"]["rows"][65536]["ip"]["time"] = 41.0
        picks = at.choose(results, "all_reduce", 3.0)
        self.assertEqual([p["size"] for p in picks], sizes)
        self.assertEqual([p["best"] for p in picks], ["Ring/LL", "Ring/LL", "Ring/LL128", "Ring/LL128"])
        self.assertEqual([p["row"] for p in picks], [True, True, False, False])  # 1.5% < 3%; ip slower
        self.assertAlmostEqual(picks[0]["gain"], 25.0)
        rows = at.table_rows("all_reduce", picks, 1, 8)
        self.assertEqual(len(rows), 1)  # the two Ring/LL buckets merge
        self.assertEqual((rows[0]["min"], rows[0]["max"], rows[0]["algo"], rows[0]["proto"]), (0, 8192, "Ring", "LL"))

    def test_written_table_parses_with_the_plugin_parser(self):
        picks = [{"size": 1024, "best": "Tree/LL", "row": True}, {"size": 4096, "best": "Ring/Simple", "row": False},
                 {"size": 16384, "best": "NVLSTree/Simple", "row": True},
                 {"size": 65536, "best": "CollNetDirect/Simple", "row": True}]
        rows = at.table_rows("reduce_scatter", picks, 2, 16)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.csv")
            at.write_table(path, rows, ["a comment", "another"])
            with open(path) as f:
                text = f.read()
            self.assertTrue(text.startswith("# a comment\n# another\n" + at.TABLE_HEADER + "\n"))
            self.assertIn("reducescatter,0,2048,tree,ll,-1,2,16\n", text)
            self.assertIn("reducescatter,8193,32768,nvls_tree,simple,-1,2,16\n", text)
            self.assertIn("reducescatter,32769,-1,collnet_direct,simple,-1,2,16\n", text)
            lint = subprocess.run([LINT, path], capture_output=True, text=True)
            self.assertEqual(lint.returncode, 0, lint.stderr + lint.stdout)
            self.assertIn("ok: 3 rows, 0 overlapping", lint.stdout)


class WholeRun(unittest.TestCase):
    """scripts/autotune against the fake nccl-tests, as a user would run it."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="mplane-autotune-")
        cls.tests_dir = os.path.join(cls.tmp, "nccl-tests")
        os.makedirs(cls.tests_dir)
        for c in at.COLLECTIVES:
            p = os.path.join(cls.tests_dir, f"{c}_perf")
            with open(p, "w") as f:
                f.write(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" {c} "$@"\n')
            os.chmod(p, 0o755)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def autotune(self, name, *args, env=None, expect=0):
        out = os.path.join(self.tmp, name, "table.csv")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        e = dict(os.environ)
        for k in ("NCCL_ALGO", "NCCL_PROTO", "MPLANE_TUNER_CONFIG", "NCCL_TUNER_PLUGIN", "NCCL_NVLS_ENABLE",
                  "NCCL_COLLNET_ENABLE"):
            e.pop(k, None)
        e.update(env or {})
        e["NCCL_TESTS_DIR"] = self.tests_dir
        r = subprocess.run([sys.executable, AUTOTUNE, "-o", out, "--plugin", PLUGIN_DIR] + list(args), env=e,
                           capture_output=True, text=True, timeout=300)
        if r.returncode != expect:
            self.fail(f"autotune exit {r.returncode} (wanted {expect})\n{r.stdout}\n{r.stderr}")
        return out, r.stdout

    @staticmethod
    def rows(path):
        with open(path) as f:
            return list(csv.DictReader(l for l in f if not l.startswith("#")))

    @staticmethod
    def choice(rows, coll, size):
        for r in rows:
            if r["collective"] == coll and int(r["min_bytes"]) <= size and (
                    int(r["max_bytes"]) < 0 or size <= int(r["max_bytes"])):
                return f"{r['algorithm']}/{r['protocol']}"
        return None

    def test_full_sweep_finds_the_known_best(self):
        path, out = self.autotune("full", "-g", "2", "-b", "8", "-e", "64M", "-f", "4")
        # Progress, per run.
        self.assertIn("[  1/37 ", out)  # 5 default, 22 forced, 10 verification
        self.assertIn("not tried: CollNetChain (NCCL_COLLNET_ENABLE is not 1); CollNetDirect (NCCL_COLLNET_ENABLE "
                      "is not 1); PAT (PAT needs one GPU per node)", out)
        self.assertNotIn("CollNetChain/Simple  NCCL", out)
        self.assertRegex(out, r"all_reduce     NVLSTree/Simple .*n/a \(.*no algorithm/protocol available")
        # The plugin's own parser accepts the table, with no overlapping rows.
        lint = subprocess.run([LINT, path], capture_output=True, text=True)
        self.assertEqual(lint.returncode, 0, lint.stderr + lint.stdout)
        rows = self.rows(path)
        self.assertTrue(all(r["nodes"] == "1" and r["ranks"] == "2" and r["channels"] == "-1" for r in rows))
        # The fake machine: Tree/LL is fastest for small all-reduces, Ring/LL128 in the middle, NCCL's own
        # Ring/Simple from ~1.4 MB, NVLS/Simple from ~12 MB. NCCL's default is Ring/LL below 16 KiB.
        self.assertEqual(self.choice(rows, "allreduce", 8), "tree/ll")
        self.assertEqual(self.choice(rows, "allreduce", 32768), "tree/ll")
        self.assertEqual(self.choice(rows, "allreduce", 512 << 10), "ring/ll128")
        self.assertIsNone(self.choice(rows, "allreduce", 2 << 20))  # NCCL's choice is the best: no row
        self.assertIsNone(self.choice(rows, "allreduce", 8 << 20))
        self.assertEqual(self.choice(rows, "allreduce", 32 << 20), "nvls/simple")
        self.assertEqual(self.choice(rows, "allreduce", 1 << 40), "nvls/simple")  # last bucket is open
        self.assertIsNone(self.choice(rows, "broadcast", 8))  # Ring/LL is NCCL's choice already
        self.assertEqual(self.choice(rows, "broadcast", 128 << 10), "ring/ll128")
        self.assertIsNone(self.choice(rows, "broadcast", 32 << 20))  # no NVLS broadcast
        self.assertEqual(self.choice(rows, "allgather", 32 << 20), "nvls/simple")
        self.assertEqual(self.choice(rows, "reducescatter", 128 << 10), "ring/ll128")
        # Verification ran the fake with the table through the plugin path, side by side.
        self.assertIn("== all_reduce: NCCL's choice vs the tuned table", out)
        self.assertRegex(out, r"\n\s+8 B\s+0\.00\s+0\.00\s+\+25\.0%\s+tree/ll\s+better")
        self.assertRegex(out, r"\n\s+2 MiB\s+95\.37\s+95\.37\s+\+0\.0%\s+\(NCCL\)")
        self.assertNotIn("WORSE", out)
        self.assertIn("all_reduce      better at 10 sizes, worse at  0", out)
        with open(path[:-4] + ".json") as f:
            report = json.load(f)
        self.assertEqual(report["ranks"], 2)
        self.assertEqual(report["nccl"], "2.28.9")
        cmp = {r["size"]: r for r in report["compare"]["all_reduce"]}
        self.assertAlmostEqual(cmp[32 << 20]["change_pct"], 16.5, delta=0.2)
        self.assertTrue(os.path.exists(os.path.join(os.path.dirname(path), "table-logs", "all_reduce-tuned.log")))
        with open(os.path.join(os.path.dirname(path), "table-logs", "all_reduce-tuned.log")) as f:
            first = f.readline()
        self.assertIn("NCCL_TUNER_PLUGIN=" + os.path.join(PLUGIN_DIR, "libnccl-tuner-mplane.so"), first)
        self.assertIn("MPLANE_TUNER_CONFIG=" + path, first)
        self.assertIn(" -c 1", first)  # the tuned run checks results

    def test_what_is_tried_follows_the_machine(self):
        _, out = self.autotune("nvls-off", "-g", "2", "--dry-run", env={"NCCL_NVLS_ENABLE": "0"})
        self.assertIn("NVLS (NCCL_NVLS_ENABLE=0); NVLSTree (NCCL_NVLS_ENABLE=0)", out)
        self.assertNotIn("NCCL_ALGO=NVLS", out)  # multicast stays off: never forced on
        self.assertIn("NCCL_ALGO=Tree NCCL_PROTO=LL128", out)
        _, out = self.autotune("collnet-pat", "-g", "1", "--dry-run", env={"NCCL_COLLNET_ENABLE": "1"})
        self.assertNotIn("not tried", out)
        self.assertIn("NCCL_ALGO=PAT NCCL_PROTO=Simple", out)
        self.assertIn("NCCL_ALGO=CollNetChain NCCL_PROTO=Simple", out)
        self.assertNotIn("NCCL_ALGO=PAT NCCL_PROTO=LL ", out)  # PAT runs Simple only
        _, out = self.autotune("every", "-g", "2", "-c", "broadcast", "--dry-run", "--every-combination",
                               env={"NCCL_NVLS_ENABLE": "0"})
        self.assertIn("NCCL_ALGO=NVLS NCCL_PROTO=LL ", out)
        self.assertIn("NCCL_ALGO=CollNetChain NCCL_PROTO=LL128", out)

    def test_budget_skips_low_priority_runs(self):
        path, out = self.autotune("budget", "-g", "2", "-c", "all_reduce", "-e", "1M", "-f", "8", "--budget", "3",
                                  env={"FAKE_SLEEP": "0.4"})
        self.assertRegex(out, r"budget: skipped \d+ runs: .*all_reduce NVLSTree/Simple")
        self.assertNotIn("all_reduce     NVLSTree/Simple", out)
        self.assertIn("all_reduce     Ring/LL ", out)  # the first priority always fits
        self.assertIn("== all_reduce: NCCL's choice vs the tuned table", out)  # verification was reserved
        report = json.load(open(path[:-4] + ".json"))
        self.assertLess(len(report["sweep"]["all_reduce"]), 9)  # default + fewer than the 8 combinations

    def test_hung_run_is_killed(self):
        path, out = self.autotune("hang", "-g", "2", "-c", "broadcast", "-e", "64K", "--run-timeout", "2",
                                  "--no-verify", env={"FAKE_HANG": "Ring/LL128"})
        self.assertRegex(out, r"broadcast\s+Ring/LL128 .*timed out after \d+s: n/a")
        self.assertIn("broadcast      Ring/Simple", out)  # the sweep went on
        self.assertIn("Ring/LL128 n/a", out)

    def test_default_failure_is_reported(self):
        path, out = self.autotune("fail", "-g", "2", "-c", "reduce", "-e", "4K", "--no-verify",
                                  env={"FAKE_FAIL_DEFAULT": "1"}, expect=1)
        self.assertIn("reduce: NCCL's default run failed: no rows for it", out)
        self.assertEqual(self.rows(path), [])

    def test_shape_from_output_and_any_shape(self):
        path, _ = self.autotune("shape", "-g", "4", "-c", "all_reduce", "-e", "64K", "--no-verify",
                                env={"FAKE_NODES": "2"})
        rows = self.rows(path)
        self.assertTrue(rows)
        self.assertTrue(all(r["nodes"] == "2" and r["ranks"] == "8" for r in rows))
        path, _ = self.autotune("anyshape", "-g", "4", "-c", "all_reduce", "-e", "64K", "--no-verify",
                                "--any-shape")
        self.assertTrue(all(r["nodes"] == "-1" and r["ranks"] == "-1" for r in self.rows(path)))

    def test_extra_env_reaches_every_run_and_user_forcing_is_dropped(self):
        path, out = self.autotune("env", "-g", "2", "-c", "broadcast", "-e", "64K", "--dry-run",
                                  "--env", "NCCL_P2P_DISABLE=1", "--env", "NCCL_SHM_DISABLE=1",
                                  env={"NCCL_ALGO": "Tree"})
        self.assertIn("extra env: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1", out)
        self.assertIn("note: ignoring NCCL_ALGO=Tree from the environment", out)
        self.assertIn("NCCL_TUNER_PLUGIN=none NCCL_ALGO=Ring NCCL_PROTO=LL128 " + self.tests_dir +
                      "/broadcast_perf -b 8 -e 65536 -f 2 -g 2 -n 20 -w 5 -c 0", out)
        self.assertFalse(os.path.exists(path))  # a dry run writes nothing

    def test_bad_arguments(self):
        r = subprocess.run([sys.executable, AUTOTUNE, "-c", "all_to_all"], capture_output=True, text=True,
                           env=dict(os.environ, NCCL_TESTS_DIR=self.tests_dir))
        self.assertEqual(r.returncode, 2)
        self.assertIn("unknown collective 'all_to_all'", r.stderr)
        r = subprocess.run([sys.executable, AUTOTUNE, "-e", "1.5G"], capture_output=True, text=True,
                           env=dict(os.environ, NCCL_TESTS_DIR=self.tests_dir))
        self.assertEqual(r.returncode, 2)
        self.assertIn("not a size: '1.5G'", r.stderr)
        e = dict(os.environ)
        e.pop("NCCL_TESTS_DIR", None)
        r = subprocess.run([sys.executable, AUTOTUNE], capture_output=True, text=True, env=e)
        self.assertEqual(r.returncode, 2)
        self.assertIn("set NCCL_TESTS_DIR", r.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=2)
