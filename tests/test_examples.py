"""The examples `make demo` runs, each under torchrun on as many ranks as the Makefile gives it.
Every example checks its own results against a reference (a single-process model, gloo, or
closed-form values) and exits non-zero on a mismatch; here each must exit 0 within a deadline
and print its line of success. A hang kills torchrun's whole process group."""
import os
import re
import signal
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cam_testing import cam_segments  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
DEADLINE_S = 180


def makefile_examples():
    # The demo target is the one statement of which examples run on how many ranks.
    with open(os.path.join(ROOT, "Makefile")) as f:
        text = f.read()
    found = re.findall(r"torchrun --nproc-per-node (\S+) examples/(\w+)\.py", text)
    return [(int(n) if n.isdigit() else 4, name) for n, name in found]  # $(NPROC) defaults to 4


# What each example prints once all of its checks have passed.
SUCCESS = {
    "demo": r"gloo/cam",
    "moe_layer": r"all checks passed",
    "kv_transfer": r"bit for bit: PASS",
    "rl_weight_sync": r"versions, .*: OK",
    "afd_decode": r"logits match the single-process model",
}


class ExamplesTest(unittest.TestCase):
    def test_every_demo_example(self):
        examples = makefile_examples()
        self.assertEqual(sorted(name for _, name in examples), sorted(SUCCESS), "Makefile and this test disagree")
        for nproc, name in examples:
            with self.subTest(example=name, nproc=nproc):
                cmd = [TORCHRUN, "--nproc-per-node", str(nproc), f"examples/{name}.py"]
                p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
                try:
                    out, _ = p.communicate(timeout=DEADLINE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    out, _ = p.communicate()
                    self.fail(f"{name} ran past {DEADLINE_S} s:\n{out[-4000:]}")
                self.assertEqual(p.returncode, 0, f"{name} failed:\n{out[-4000:]}")
                self.assertRegex(out, SUCCESS[name], f"{name} exited 0 without its success line")
        self.assertEqual(cam_segments(), [])


if __name__ == "__main__":
    unittest.main()
