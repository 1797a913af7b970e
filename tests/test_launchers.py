"""The documented launchers start a working run: torchrun, and `srun examples/srun_train.sh`
(one torchrun per node; Slurm's launcher facts emulated here for one node of 2 CPU ranks). The
run is checked through the checkpoint it writes (world size, ep x dp), not its printed output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from schemoe.dist.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["--device", "cpu", "--ep-size", "1", "--steps", "2", "--eval-seqs", "0", "--layers", "2",
         "--model-dim", "32", "--hidden-dim", "64", "--corpus-bytes", "20000"]  # fmt: skip


def _meta(folder: Path) -> dict:
    latest = (folder / "latest").read_text().strip()
    return json.loads((folder / latest / "meta.json").read_text())


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env | extra


def test_torchrun_starts_two_ranks_with_expert_and_data_parallel_groups(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "-m", "schemoe", "train", *TRAIN, "--save", str(tmp_path)]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, timeout=300, capture_output=True)
    meta = _meta(tmp_path)
    assert meta["world_size"] == 2 and meta["args"]["ep_size"] == 1


def test_the_srun_script_hands_slurm_launcher_facts_to_torchrun(tmp_path):
    env = _env(SLURM_NNODES="1", SLURM_NODEID="0", SLURM_GPUS_ON_NODE="2",
               MASTER_PORT=str(free_port()))  # fmt: skip
    cmd = ["bash", str(ROOT / "examples" / "srun_train.sh"), *TRAIN, "--save", str(tmp_path)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=300, capture_output=True)
    assert _meta(tmp_path)["world_size"] == 2
