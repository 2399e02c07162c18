#!/usr/bin/env python3
"""scripts/torch-smoke.py without torch or a GPU: the size grammar, the uneven all-to-all splits, the
per-rank environment (emulated nodes), and the reading of NCCL's INFO logs and the plugin's counter
files that decide which network carried the traffic."""
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.environ.get("TORCH_SMOKE", os.path.join(HERE, "..", "..", "scripts", "torch-smoke.py"))


def load():
    loader = importlib.machinery.SourceFileLoader("torch_smoke", SCRIPT)
    spec = importlib.util.spec_from_loader("torch_smoke", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


ts = load()

# Lines as NCCL 2.28 writes them (INIT,NET), for a run through mplane between two emulated nodes.
LOG_MPLANE = """\
host:1:1 [0] NCCL INFO NET/Plugin: Loaded net plugin mplane (v11)
host:1:1 [0] NCCL INFO Using network mplane
host:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/mplane/0
host:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] [send] via NET/mplane/1
host:1:1 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/mplane/0
"""
LOG_P2P = """\
host:2:2 [1] NCCL INFO Using network Socket
host:2:2 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [send] via P2P/CUMEM
host:2:2 [1] NCCL INFO Channel 01/0 : 1[1] -> 0[0] [send] via SHM/direct/direct
host:2:2 [1] NCCL WARN NET/mplane MPLANE_SOCKET_STREAMS='abc' is not valid
"""


class Sizes(unittest.TestCase):
    def test_suffixes(self):
        self.assertEqual(ts.parse_size("64M"), 64 << 20)
        self.assertEqual(ts.parse_size("1g"), 1 << 30)
        self.assertEqual(ts.parse_size("4KiB"), 4096)
        self.assertEqual(ts.parse_size("100"), 100)
        self.assertEqual(ts.parse_sizes("1M, 2M"), [1 << 20, 2 << 20])

    def test_bad(self):
        for bad in ("", "0", "-1", "1T", "abc", "1.5M"):
            with self.assertRaises(Exception, msg=bad):
                ts.parse_size(bad)

    def test_fmt(self):
        self.assertEqual(ts.fmt_bytes(64 << 20), "64M")
        self.assertEqual(ts.fmt_bytes(1000), "1000")


class UnevenSplits(unittest.TestCase):
    def test_shape_zeros_and_balance(self):
        for w in (2, 3, 4, 8):
            s = ts.uneven_splits(w, 10)
            self.assertEqual(len(s), w)
            self.assertTrue(all(len(row) == w for row in s))
            flat = [x for row in s for x in row]
            self.assertIn(0, flat, "some splits are empty")
            self.assertGreater(len(set(flat)), 1, "splits differ")
            self.assertTrue(all(sum(row) > 0 for row in s), "every rank sends something")


class TrafficClass(unittest.TestCase):
    def test_names_follow_mplane_classes(self):
        self.assertEqual([ts.parse_traffic_class(n) for n in ("default", "collective", "AllToAll", "lowlat", "storage")],
                         [0, 1, 2, 3, 4])
        self.assertEqual(ts.parse_traffic_class("7"), 7)
        with self.assertRaises(Exception):
            ts.parse_traffic_class("bulk")

    def test_table_matches_tc_map_h(self):
        sys.path.insert(0, HERE)
        import cheader
        with open(os.path.join(HERE, "..", "..", "common", "tc_map.h")) as f:
            h = cheader.parse(f.read())
        plugin = {n[len("MPLANE_TC_"):].lower(): v for n, v in h.enums.items()
                  if n.startswith("MPLANE_TC_") and n != "MPLANE_TC_NCLASSES"}
        self.assertEqual(ts.TRAFFIC_CLASSES, plugin)


class RankEnv(unittest.TestCase):
    def cfg(self, **kw):
        c = {"nprocs": 4, "emulate_nodes": 2, "backend": "nccl", "log_dir": "/tmp/x", "hostid_prefix": "p-node"}
        c.update(kw)
        return c

    def test_emulated_nodes_get_one_hostid_per_group(self):
        ids = [ts.rank_env(r, self.cfg())["NCCL_HOSTID"] for r in range(4)]
        self.assertEqual(ids, ["p-node0", "p-node0", "p-node1", "p-node1"])

    def test_one_node_sets_no_hostid(self):
        env = ts.rank_env(1, self.cfg(emulate_nodes=1))
        self.assertNotIn("NCCL_HOSTID", env)
        self.assertEqual(env["NCCL_DEBUG_FILE"], "/tmp/x/nccl-rank1.log")


class NetworkReport(unittest.TestCase):
    def test_reads_network_plugin_and_channels(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "nccl-rank0.log"), "w") as f:
                f.write(LOG_MPLANE)
            with open(os.path.join(d, "nccl-rank1.log"), "w") as f:
                f.write(LOG_P2P)
            r0, r1, r2 = ts.read_network_report(d, 3)
            self.assertEqual(r0["using"], ["mplane"])
            self.assertEqual(r0["plugin"], "mplane (v11)")
            self.assertEqual(r0["net_channels"], {"mplane": 2})  # [receive] lines are not counted
            self.assertEqual((r0["p2p_channels"], r0["shm_channels"]), (0, 0))
            self.assertEqual(r1["using"], ["Socket"])
            self.assertIsNone(r1["plugin"])
            self.assertEqual((r1["p2p_channels"], r1["shm_channels"]), (1, 1))
            self.assertEqual(len(r1["warnings"]), 1)
            self.assertTrue(r2.get("missing"))

    def test_plugin_counters_are_summed(self):
        with tempfile.TemporaryDirectory() as d:
            for pid, tx in ((11, 100), (12, 50)):
                with open(os.path.join(d, f"mplane-stats.{pid}.json"), "w") as f:
                    json.dump({"pid": pid, "planes": [{"plane": 0, "tx_bytes": tx, "rx_bytes": 2 * tx}],
                               "classes": [{"class": "default", "sl": 0, "tx_bytes": 0},
                                           {"class": "alltoall", "sl": 3, "tx_bytes": tx}]}, f)
            with open(os.path.join(d, "mplane-stats.13.json"), "w") as f:
                f.write("{truncated")
            self.assertEqual(ts.read_plugin_stats(d), {"files": 2, "tx_bytes": 150, "rx_bytes": 300,
                                                       "class_tx_bytes": {"default": 0, "alltoall": 150}})
            self.assertIsNone(ts.read_plugin_stats(os.path.join(d, "nothing")))


if __name__ == "__main__":
    unittest.main(verbosity=2)
