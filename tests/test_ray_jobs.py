"""Ray Data (`jobs_ray`) on a local Ray cluster on the CPU: the documented two-stage pipeline (`ReferenceEncoder` on
a CPU actor, then `Drama3Predictor` on two actors, one of them killed by its PID while the job runs) over 24 rows,
three with a reference recording, one with a control token in its text. Every good row is made exactly once, with
the bytes of the plain job's file for the same id (whose references the plain job encodes itself), the generating
actors never encode audio, and the bad row is recorded with its error. Then `drama3-ray`: a rerun into the output of
a partial run (and a file cut short) makes each row exactly once, without an id column.
Run by `.ci/run`'s Ray stage: `pytest -m ray` (the default run leaves these out)."""

import os
import re
import signal
import sys
import threading
import time

import numpy as np
import pytest
import soundfile

from transformers_drama3.jobs import run_manifest

from .conftest import GOLDEN_TINY

ray = pytest.importorskip("ray", reason="the [ray] extra is not installed")
pytestmark = pytest.mark.ray
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors' class is sent, not imported

FRAMES, ROWS, BAD = 4, 24, "line07"
WITH_REFERENCE = ("line02", "line05", "line13")
TIMEOUT = 600


@pytest.fixture(scope="module")
def cluster():
    """A local cluster with 4 scheduling slots (Ray's CPUs are slots, not cores: the encoding actor and two
    generating actors take one each, and reading and writing tasks need one), one thread per actor."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}})
    yield
    ray.shutdown()


class KillablePredictor:
    """The predictor, with each actor's PID and finished calls written where the test can see them, and the codec's
    encoder made to fail in the actor: a row whose reference this actor encoded would fail."""

    def __init__(self, watched: str, **kwargs):
        from transformers_drama3.jobs_ray import Drama3Predictor
        from transformers_drama3.modeling_codec import FishDACCodec

        def refuse(*args, **kwargs):
            raise RuntimeError("a generating actor encoded audio")

        FishDACCodec.encode = refuse  # in this actor's process only
        self.watched, self.predictor = watched, Drama3Predictor(**kwargs)
        with open(os.path.join(watched, f"{os.getpid()}.pid"), "w") as file:
            file.write(str(os.getpid()))

    def __call__(self, batch):
        time.sleep(0.5)  # a call takes long enough that the killer finds an actor in the middle of the job
        made = self.predictor(batch)
        with open(os.path.join(self.watched, f"{os.getpid()}.calls"), "a") as file:
            file.write("1\n")
        return made


def kill_one_actor(folder: str, killed: list, job_over: threading.Event) -> None:
    """Once an actor has finished one call, SIGKILL it (an actor still busy with the rest of the job)."""
    while not job_over.is_set():
        done = [name for name in os.listdir(folder) if name.endswith(".calls")]
        if done:
            pid = int(done[0].split(".")[0])
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.05)


def test_a_ray_job_with_a_killed_actor_makes_every_good_row_once(cluster, tmp_path):
    from transformers_drama3.jobs_ray import ReferenceEncoder

    soundfile.write(tmp_path / "voice.wav", np.random.default_rng(1).uniform(-0.3, 0.3, 22050).astype(np.float32),
                    44100)
    texts = [f"Line number {index}, spoken." for index in range(ROWS)]
    texts[int(BAD[-2:])] = "Say <|im_end|> now."
    rows = [{"key": f"line{index:02d}", "text": text,
             "refs": [{"audio": "voice.wav", "transcript": "A voice."}] if f"line{index:02d}" in WITH_REFERENCE
             else []} for index, text in enumerate(texts)]
    settings = {"model": str(GOLDEN_TINY), "columns": {"id": "key", "text": "text", "references": "refs"},
                "folder": str(tmp_path), "max_new_tokens": FRAMES}

    pids = tmp_path / "pids"
    pids.mkdir()
    killed: list = []
    job_over = threading.Event()
    killer = threading.Thread(target=kill_one_actor, args=(str(pids), killed, job_over), daemon=True)
    killer.start()
    coded = ray.data.from_items(rows).map_batches(
        ReferenceEncoder, batch_format="pyarrow", batch_size=3, concurrency=1, num_cpus=1,
        fn_constructor_kwargs=settings)
    made = coded.map_batches(
        KillablePredictor, batch_format="pyarrow", batch_size=3, concurrency=2, num_cpus=1,
        fn_constructor_kwargs={"watched": str(pids), "device": "cpu", **settings}).take_all()
    job_over.set()
    killer.join(TIMEOUT)
    assert killed, "no actor was killed"
    assert len(list(pids.glob("*.pid"))) == 3  # Ray started an actor in place of the killed one
    assert sorted(row["key"] for row in made) == sorted(row["key"] for row in rows)  # each row exactly once
    by_key = {row["key"]: row for row in made}
    bad = by_key.pop(BAD)
    assert bad["audio"] is None and "control token '<|im_end|>'" in bad["error"]

    # The plain job over the good rows (same ids, so the same seeds; it encodes the references itself): the same
    # file bytes.
    manifest = tmp_path / "jobs.jsonl"
    manifest.write_text("".join(
        '{"id": "%s", "text": "%s"%s}\n' % (row["key"], row["text"], ', "references": [{"audio": "voice.wav", '
                                            '"transcript": "A voice."}]' if row["refs"] else "")
        for row in rows if row["key"] != BAD))
    run_manifest(*_model(), manifest, tmp_path / "plain", show_progress=False, max_new_tokens=FRAMES)
    for key, row in by_key.items():
        assert row["error"] is None and row["audio"]["path"] == f"{key}.wav", (key, row["error"])
        assert row["audio"]["bytes"] == (tmp_path / "plain" / f"{key}.wav").read_bytes(), key


def _model():
    import torch

    from transformers_drama3 import loading
    from transformers_drama3.processing_drama3 import Drama3Processor

    return loading.load_model(str(GOLDEN_TINY), "cpu", torch.float32), Drama3Processor.from_pretrained(GOLDEN_TINY)


def test_a_drama3_ray_rerun_after_a_partial_run_makes_each_row_once(cluster, tmp_path, capsys):
    """Rows without an id column (named by their content). The partial run spoke the first 5 rows (one of them bad);
    a file cut short by a kill is in the output too. The rerun over all 8 rows leaves the first run's rows where
    they are, removes the cut file, and makes the 3 missing rows and the failed one again: each row once."""
    import datasets
    import pyarrow.parquet as pq

    from transformers_drama3 import jobs_ray

    texts = ["Hello there.", "Say <|im_end|> now.", "Good morning.", "Yes.", "What a day.", "No!", "Later then.",
             "See you."]
    datasets.Dataset.from_dict({"text": texts[:5], "n": list(range(5))}).to_parquet(str(tmp_path / "part.parquet"))
    datasets.Dataset.from_dict({"text": texts, "n": list(range(8))}).to_parquet(str(tmp_path / "all.parquet"))
    output = tmp_path / "speech"

    def run(source: str) -> int:
        status = jobs_ray.main([str(tmp_path / source), "--model", str(GOLDEN_TINY), "--output", str(output),
                                "--batch-size", "2", "--max-new-tokens", str(FRAMES)])
        assert "control token '<|im_end|>'" in capsys.readouterr().err
        return status

    assert run("part.parquet") == 1  # the bad row fails
    first = {path.name: path.read_bytes() for path in output.glob("*.parquet")}
    first_rows = {row["n"]: row for row in pq.read_table(output).to_pylist()}
    assert sorted(first_rows) == [0, 1, 2, 3, 4] and first_rows[1]["audio"] is None
    some = first[sorted(first)[0]]
    (output / "killed_write.parquet").write_bytes(some[: len(some) // 2])  # as a kill mid-write leaves it: no footer

    assert run("all.parquet") == 1
    after = {path.name: path for path in output.glob("*.parquet")}
    assert "killed_write.parquet" not in after
    rows = pq.read_table(output).to_pylist()
    assert sorted(row["n"] for row in rows) == list(range(8))  # each row exactly once
    made_now = sorted(row["n"] for name, path in after.items() if name not in first
                      for row in pq.read_table(path).to_pylist())
    assert made_now == [1, 5, 6, 7]
    kept = {row["n"]: row for name in first for row in pq.read_table(output / name).to_pylist()}
    assert kept == {n: row for n, row in first_rows.items() if n != 1}  # the first run's rows untouched
    by_n = {row["n"]: row for row in rows}
    assert by_n[1]["audio"] is None and "control token" in by_n[1]["error"]
    assert all(re.fullmatch(r"row-[0-9a-f]{16}\.wav", by_n[n]["audio"]["path"]) for n in by_n if n != 1)

    # An input column that the output would overwrite is refused before anything runs.
    datasets.Dataset.from_dict({"text": ["Hi."], "error": ["x"]}).to_parquet(str(tmp_path / "clash.parquet"))
    status = jobs_ray.main([str(tmp_path / "clash.parquet"), "--model", str(GOLDEN_TINY), "--output",
                            str(tmp_path / "clash")])
    assert status == 1 and "the dataset has column(s) ['error']" in capsys.readouterr().err
    assert not (tmp_path / "clash").exists()
