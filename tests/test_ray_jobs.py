"""Ray Data (`jobs_ray`) on a local Ray cluster on the CPU. `drama3-ray` without --address on a 2-core machine
starts a cluster it cannot hang on (a CPU more than its actors), stops on Ctrl-C with one line and 130, and makes an
audio dataset in the input's order (a save_to_disk folder with an audio column of references) with the bytes of
`drama3-tts --dataset`; a rerun with nothing to do starts no Ray. Bad input (duplicate ids in a CSV, a missing
column, a save_to_disk folder with a missing recording and a control token) is refused by the driver before Ray
starts. The documented two-stage pipeline (`ReferenceEncoder` on a CPU actor, then `Drama3Predictor` on two actors,
one of them killed by its PID while the job runs) over 24 rows, three with a reference recording, one with a control
token in its text: every good row is made exactly once, with the bytes of the plain job's file for the same id, the
generating actors never encode audio, and the bad row is recorded with its error. Then `drama3-ray` again: a rerun
into the output of a partial run (and a file cut short) makes each row exactly once, without an id column.
Run by `.ci/run`'s Ray stage: `pytest -m ray` (the default run leaves these out)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from transformers_drama3 import cli
from transformers_drama3.jobs import run_manifest
from transformers_drama3.jobs_items import undecoded

from .conftest import GOLDEN_TINY, default_sigint
from .test_jobs import write_cut_flac

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


def reference_rows(folder) -> "datasets.Dataset":
    """Six rows with a reference recording in an audio column (`datasets.Audio`, the file's bytes stored in the
    dataset) on rows 1 and 4, and a transcript column."""
    import datasets

    rng = np.random.default_rng(2)
    soundfile.write(folder / "voice.wav", rng.uniform(-0.3, 0.3, 22050).astype(np.float32), 44100)
    texts = ["Hello there.", "Good morning.", "Yes.", "What a day.", "No!", "See you."]
    refs = [str(folder / "voice.wav") if index in (1, 4) else None for index in range(len(texts))]
    rows = datasets.Dataset.from_dict({"text": texts, "ref": refs,
                                       "ref_text": [None if ref is None else "A voice." for ref in refs]})
    return rows.cast_column("ref", datasets.Audio(decode=False)).map(
        lambda row: {"ref": None if row["ref"] is None else {"bytes": Path(row["ref"]["path"]).read_bytes(),
                                                             "path": "voice.wav"}}).cast_column("ref", datasets.Audio())


def drama3_ray(arguments: list[str], cores: int) -> subprocess.Popen:
    """`drama3-ray ARGUMENTS` in a process of its own, with Ray not started yet, on a machine of `cores` cores
    (os.cpu_count answers that number: what Ray and the command count)."""
    code = ("import os, sys; os.cpu_count = lambda: %d; from transformers_drama3.jobs_ray import main; "
            "sys.exit(main(sys.argv[1:]))" % cores)
    return subprocess.Popen([sys.executable, "-c", code, *arguments], stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)


def test_drama3_ray_on_the_local_cluster_it_starts_on_two_cores(tmp_path, monkeypatch, capsys):
    """No --address on a 2-core machine: the local cluster gets 3 CPUs (2 actors and the reading), so the job
    finishes (with 2 CPUs the read task waited forever). The input is a save_to_disk folder with an audio column of
    references. A first run stopped by Ctrl-C prints one line and exits with 130; the rerun makes the audio
    dataset, row for row the bytes of drama3-tts --dataset; a third run has nothing to do and starts no Ray."""
    from transformers_drama3 import jobs_ray

    reference_rows(tmp_path).save_to_disk(str(tmp_path / "rows"))
    flags = ["--model", str(GOLDEN_TINY), "--max-new-tokens", str(FRAMES), "--column", "reference_audio=ref",
             "--column", "reference_transcript=ref_text"]
    command = [str(tmp_path / "rows"), "--output", str(tmp_path / "speech"), "--batch-size", "2", *flags]

    stopped = drama3_ray(command, cores=2)
    lines = []
    for line in stopped.stderr:  # Ctrl-C once the cluster is up and the job under way
        lines.append(line)
        if "a local Ray cluster of 3 CPUs" in line:
            time.sleep(3)
            stopped.send_signal(signal.SIGINT)
            break
    rest = stopped.communicate(timeout=TIMEOUT)[1]
    assert stopped.returncode == 130, "".join(lines) + rest
    assert rest.rstrip().splitlines()[-1] == "drama3-ray: interrupted" and "Traceback" not in rest, rest

    finished = drama3_ray(command, cores=2)
    error = finished.communicate(timeout=TIMEOUT)[1]
    assert finished.returncode == 0, error
    assert "a local Ray cluster of 3 CPUs" in error and ", 0 failed: the audio dataset is in" in error, error
    made = audio_rows(tmp_path / "speech")
    assert [row["text"] for row in made] == list(reference_rows(tmp_path)["text"])  # the input's order

    assert cli.main([*flags, "--dataset", str(tmp_path / "rows"), "--output-dataset", str(tmp_path / "plain"),
                     "--quiet"]) == 0
    plain = {row["audio"]["path"]: row["audio"]["bytes"] for row in load_plain(tmp_path / "plain")}
    assert {row["audio"]["path"]: row["audio"]["bytes"] for row in made} == plain  # the same ids, the same bytes

    monkeypatch.setattr(jobs_ray, "start_ray", lambda *args: pytest.fail("Ray was started"))
    assert jobs_ray.main(command) == 0
    assert "nothing to speak: the 6 rows were made by earlier runs" in capsys.readouterr().err
    assert audio_rows(tmp_path / "speech") == made


def load_plain(folder) -> list[dict]:
    import datasets

    return list(undecoded(datasets.load_from_disk(str(folder))))


def test_drama3_ray_refuses_bad_input_before_ray_starts(tmp_path, monkeypatch, capsys):
    """The driver's checks, those of drama3-tts --dataset, before Ray starts (no actor, no model): a CSV with a
    duplicate id (its int column with an empty cell is fine), a parquet file without the text column, and a
    save_to_disk folder (read as its rows, not as its state.json) with a missing recording and a control token:
    each one message naming every bad row."""
    import datasets

    from transformers_drama3 import jobs_ray

    monkeypatch.setattr(jobs_ray, "start_ray", lambda *args: pytest.fail("Ray was started"))

    def refused(source, *flags) -> str:
        status = jobs_ray.main([str(source), "--model", str(GOLDEN_TINY), "--output", str(tmp_path / "out"), *flags])
        assert status == 1 and not (tmp_path / "out" / "data").exists()
        return capsys.readouterr().err

    (tmp_path / "rows.csv").write_text("key,text,speaker\na,Hello.,1\nb,Hi.,\na,Again.,2\n")
    error = refused(tmp_path / "rows.csv", "--id-column", "key", "--column", "speaker=speaker")
    assert "row 2: id 'a' is used on row 0 too; ids must be unique" in error and "speaker" not in error

    datasets.Dataset.from_dict({"words": ["Hello."]}).to_parquet(str(tmp_path / "words.parquet"))
    error = refused(tmp_path / "words.parquet")
    assert "the dataset has no column 'text'; its columns are ['words']" in error

    rows = datasets.Dataset.from_dict({"text": ["Fine.", "Hi.", "Say <|im_end|> now."],
                                       "refs": [[], [{"audio": "gone.wav", "transcript": "Gone."}], []]})
    rows.save_to_disk(str(tmp_path / "saved"))
    error = refused(tmp_path / "saved", "--column", "references=refs")
    assert "2 problems in" in error and "row 1: no such file: references audio" in error and "gone.wav" in error
    assert "row 2 (id row2): text contains the control token '<|im_end|>'" in error

    # Usage errors (exit status 2) before anything is read: an output that is a file, a negative GPU count.
    for flags, message in ((["--output", str(tmp_path / "words.parquet")], "is a file: give a folder"),
                           (["--output", str(tmp_path / "out"), "--num-gpus", "-1"], "--num-gpus must be at least 0")):
        with pytest.raises(SystemExit) as exit_:
            jobs_ray.main([str(tmp_path / "words.parquet"), "--model", str(GOLDEN_TINY), *flags])
        assert exit_.value.code == 2 and message in capsys.readouterr().err

    # A local cluster without the GPUs the actors ask for is refused before it starts.
    monkeypatch.undo()
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: pytest.fail("Ray was started"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as drama3-ray finds it, whatever ran before
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    more = torch.cuda.device_count() + 1
    error = refused(tmp_path / "words.parquet", "--text-column", "words", "--num-gpus", "1", "--concurrency", str(more))
    assert f"--concurrency {more} x --num-gpus 1 asks for {more} GPUs, and this machine has {more - 1}" in error


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
        ReferenceEncoder, batch_format="pyarrow", batch_size=3, compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=1, fn_constructor_kwargs=settings)
    made = coded.map_batches(
        KillablePredictor, batch_format="pyarrow", batch_size=3, compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=1, fn_constructor_kwargs={"watched": str(pids), "device": "cpu", **settings}).take_all()
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
    """Rows without an id column (given the ids of drama3-tts --dataset). The partial run spoke the first 5 rows,
    one of them with a recording that cannot be decoded (its header reads: it fails in the CPU stage, not in the
    driver's checks); a file cut short by a kill is in the output too. The rerun over all 8 rows leaves the first
    run's rows where they are, removes the cut file, and makes the 3 missing rows and the failed one again: each row
    once in Ray's files, and the audio dataset in the rows' order."""
    import datasets
    import pyarrow.parquet as pq

    from transformers_drama3 import jobs_ray

    write_cut_flac(tmp_path / "cut.flac")
    texts = ["Hello there.", "Cut short.", "Good morning.", "Yes.", "What a day.", "No!", "Later then.", "See you."]
    rows = {"text": texts, "n": list(range(8)), "ref": [None, "cut.flac", *[None] * 6],
            "ref_text": [None, "A cut recording.", *[None] * 6]}
    datasets.Dataset.from_dict({name: value[:5] for name, value in rows.items()}).to_parquet(
        str(tmp_path / "part.parquet"))
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "all.parquet"))
    output, parts = tmp_path / "speech", tmp_path / "speech" / jobs_ray.RAY_FOLDER

    def run(source: str) -> int:
        status = jobs_ray.main([str(tmp_path / source), "--model", str(GOLDEN_TINY), "--output", str(output),
                                "--batch-size", "2", "--max-new-tokens", str(FRAMES), "--column", "reference_audio=ref",
                                "--column", "reference_transcript=ref_text"])
        assert "row 1: id row1: " in capsys.readouterr().err and "cut.flac" in error_of(output, 1)
        return status

    assert run("part.parquet") == 1  # the cut recording fails
    first = {path.name: path.read_bytes() for path in parts.glob("*.parquet")}
    first_rows = {row["n"]: row for row in pq.read_table(parts).to_pylist()}
    assert sorted(first_rows) == [0, 1, 2, 3, 4] and first_rows[1]["audio"] is None
    some = first[sorted(first)[0]]
    (parts / "killed_write.parquet").write_bytes(some[: len(some) // 2])  # as a kill mid-write leaves it: no footer

    assert run("all.parquet") == 1
    after = {path.name: path for path in parts.glob("*.parquet")}
    assert "killed_write.parquet" not in after
    assert sorted(row["n"] for row in pq.read_table(parts).to_pylist()) == list(range(8))  # each row exactly once
    made_now = sorted(row["n"] for name, path in after.items() if name not in first
                      for row in pq.read_table(path).to_pylist())
    assert made_now == [1, 5, 6, 7]
    kept = {row["n"]: row for name in first for row in pq.read_table(parts / name).to_pylist()}
    assert kept == {n: row for n, row in first_rows.items() if n != 1}  # the first run's rows untouched

    made = audio_rows(output)
    assert [row["n"] for row in made] == list(range(8)) and made[1]["audio"] is None  # the input's order
    assert [row["audio"]["path"] for row in made if row["n"] != 1] == [f"row{n}.wav" for n in range(8) if n != 1]
    by_n = {row["n"]: row for row in pq.read_table(parts).to_pylist()}
    assert all(made[n]["audio"]["bytes"] == by_n[n]["audio"]["bytes"] for n in range(8) if n != 1)


def audio_rows(output) -> list[dict]:
    """The rows of drama3-ray's audio dataset (parquet shards in OUTPUT/data), its audio columns as stored."""
    import datasets

    made = datasets.load_dataset("parquet", data_dir=str(output / "data"), split="train",
                                 cache_dir=str(output.parent / "hf-cache"))
    assert made.features["audio"] == datasets.Audio(sampling_rate=44100)
    return list(undecoded(made))


def error_of(output, index: int) -> str:
    return audio_rows(output)[index]["error"] or ""
