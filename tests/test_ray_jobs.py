"""Ray Data (`jobs_ray.Drama3Predictor`) on a local Ray cluster on the CPU (`ray.init(num_cpus=2)`): 24 rows, one with
a control token in its text, two actors, one of them killed by its PID while the job runs. Every good row is made
exactly once, with the bytes of the plain job's file for the same id; the bad row is recorded with its error.
Run by `.ci/run`'s Ray stage: `pytest -m ray` (the default run leaves these out)."""

import os
import signal
import sys
import threading
import time

import pytest

from transformers_drama3.jobs import run_manifest

from .conftest import GOLDEN_TINY

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors' class is sent, not imported

FRAMES, ROWS, BAD = 4, 24, "line07"
TIMEOUT = 600


class KillablePredictor:
    """The predictor, with each actor's PID and finished calls written where the test can see them."""

    def __init__(self, folder: str, **kwargs):
        from transformers_drama3.jobs_ray import Drama3Predictor

        self.folder, self.predictor = folder, Drama3Predictor(**kwargs)
        with open(os.path.join(folder, f"{os.getpid()}.pid"), "w") as file:
            file.write(str(os.getpid()))

    def __call__(self, batch):
        time.sleep(0.5)  # a call takes long enough that the killer finds an actor in the middle of the job
        made = self.predictor(batch)
        with open(os.path.join(self.folder, f"{os.getpid()}.calls"), "a") as file:
            file.write("1\n")
        return made


def kill_one_actor(folder: str, killed: list) -> None:
    """Once an actor has finished one call, SIGKILL it (an actor still busy with the rest of the job)."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        done = [name for name in os.listdir(folder) if name.endswith(".calls")]
        if done:
            pid = int(done[0].split(".")[0])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.05)


def test_a_ray_job_with_a_killed_actor_makes_every_good_row_once(tmp_path):
    texts = [f"Line number {index}, spoken." for index in range(ROWS)]
    texts[int(BAD[-2:])] = "Say <|im_end|> now."
    rows = [{"key": f"line{index:02d}", "text": text} for index, text in enumerate(texts)]

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}})
    try:
        pids = tmp_path / "pids"
        pids.mkdir()
        killed: list = []
        killer = threading.Thread(target=kill_one_actor, args=(str(pids), killed), daemon=True)
        killer.start()
        made = ray.data.from_items(rows).map_batches(
            KillablePredictor, batch_format="pyarrow", batch_size=3, concurrency=2, num_cpus=1,
            fn_constructor_kwargs={"folder": str(pids), "model": str(GOLDEN_TINY), "device": "cpu",
                                   "columns": {"id": "key", "text": "text"}, "max_new_tokens": FRAMES},
        ).take_all()
        killer.join(TIMEOUT)
    finally:
        ray.shutdown()
    assert killed, "no actor was killed"
    assert len(list(pids.glob("*.pid"))) == 3  # Ray started an actor in place of the killed one
    assert sorted(row["key"] for row in made) == sorted(row["key"] for row in rows)  # each row exactly once
    by_key = {row["key"]: row for row in made}
    bad = by_key.pop(BAD)
    assert bad["audio"] is None and "control token '<|im_end|>'" in bad["error"]

    # The plain job over the good rows (same ids, so the same seeds): the same file bytes.
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text("".join(f'{{"id": "{row["key"]}", "text": "{row["text"]}"}}\n' for row in rows
                                if row["key"] != BAD))
    run_manifest(*_model(), manifest, tmp_path / "plain", show_progress=False, max_new_tokens=FRAMES)
    for key, row in by_key.items():
        assert row["error"] is None and row["audio"]["path"] == f"{key}.wav"
        assert row["audio"]["bytes"] == (tmp_path / "plain" / f"{key}.wav").read_bytes(), key


def _model():
    import torch

    from transformers_drama3 import loading
    from transformers_drama3.processing_drama3 import Drama3Processor

    return loading.load_model(str(GOLDEN_TINY), "cpu", torch.float32), Drama3Processor.from_pretrained(GOLDEN_TINY)


def test_the_drama3_ray_command(tmp_path, capsys):
    """`drama3-ray` on a local cluster: parquet in, parquet out with every row, the bad one named in the exit."""
    import datasets
    import pyarrow.parquet as pq

    from transformers_drama3 import jobs_ray

    texts = ["Hello there.", "Say <|im_end|> now.", "Good morning."]
    datasets.Dataset.from_dict({"key": ["a", "b", "c"], "text": texts}).to_parquet(str(tmp_path / "texts.parquet"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        status = jobs_ray.main([str(tmp_path / "texts.parquet"), "--model", str(GOLDEN_TINY), "--id-column", "key",
                                "--output", str(tmp_path / "speech"), "--max-new-tokens", str(FRAMES)])
    finally:
        ray.shutdown()
    assert status == 1 and "rows b failed" in capsys.readouterr().err
    rows = {row["key"]: row for row in pq.read_table(str(tmp_path / "speech")).to_pylist()}
    assert sorted(rows) == ["a", "b", "c"] and rows["b"]["audio"] is None and rows["a"]["audio"]["bytes"][:4] == b"RIFF"
