"""What a new user's first dataset job meets, checked before any model loads: a CSV whose int columns have empty
cells (read as floats), empty texts (`""`, white space, an empty cell) named as empty in the first run, a local path
that does not exist (never looked up on the Hub: a network call fails the test), `datasets` not installed (the
error names the extra), `accelerate launch` starting one process on a CPU; and a 100 kB text, split and spoken with
a progress bar over its chunks. The golden tiny checkpoint."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import datasets
import pytest

from transformers_drama3 import cli
from transformers_drama3.cli_jobs import ONE_ACCELERATE_PROCESS
from transformers_drama3.jobs_items import DATASETS_HINT, ManifestError, dataset_items, load_input_dataset, looks_local
from transformers_drama3.processing_drama3 import Drama3Processor

from .conftest import GOLDEN_TINY, default_sigint

FLAGS = ["--model", str(GOLDEN_TINY), "--max-new-tokens", "4"]


@pytest.fixture
def no_model(monkeypatch):
    monkeypatch.setattr(cli, "load_model", lambda *args: pytest.fail("the model was loaded"))


def test_a_csv_int_column_with_empty_cells_is_read_as_ints(tmp_path):
    """pandas reads an int column with an empty cell as floats: 1.0 is the speaker 1, an empty cell no speaker;
    1.5 is still refused. The items are those of the same rows written as JSON with ints."""
    (tmp_path / "rows.csv").write_text("text,speaker,seed,top_k\nHello.,1,,5\nHi.,,7,\nYes.,2,8,\n")
    rows = datasets.load_dataset("csv", data_files=str(tmp_path / "rows.csv"), split="train",
                                 cache_dir=str(tmp_path / "cache"))
    assert rows.features["speaker"] == datasets.Value("float64")  # what makes the case
    columns = {"text": "text", "speaker": "speaker", "seed": "seed", "top_k": "top_k"}
    items = dataset_items(rows, columns)
    assert [(item.speaker, item.settings) for item in items] == [(1, {"top_k": 5}), (None, {}), (2, {})]
    assert [item.seed for item in items[1:]] == [7, 8] and all(type(item.speaker) is not float for item in items)
    as_json = datasets.Dataset.from_list([{"text": "Hello.", "speaker": 1, "seed": None, "top_k": 5},
                                          {"text": "Hi.", "speaker": None, "seed": 7, "top_k": None},
                                          {"text": "Yes.", "speaker": 2, "seed": 8, "top_k": None}])
    assert [item.seed for item in dataset_items(as_json, columns)] == [item.seed for item in items]

    (tmp_path / "half.csv").write_text("text,speaker\nHello.,1.5\nHi.,\n")
    half = datasets.load_dataset("csv", data_files=str(tmp_path / "half.csv"), split="train",
                                 cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ManifestError, match=r"row 0: speaker must be a speaker number 0..15, got 1.5"):
        dataset_items(half, {"text": "text", "speaker": "speaker"})


def test_empty_texts_are_named_empty_in_the_first_run(tmp_path, no_model, capsys):
    """`""`, white space and an empty cell (None) in a dataset, and the same in a manifest, with another row's
    control token: one message, each empty text called empty (not "give exactly one of text and text_file")."""
    rows = [{"text": "Fine."}, {"text": ""}, {"text": "   "}, {"text": None}, {"text": "Say <|im_end|> now."}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert cli.main([*FLAGS, "--dataset", str(tmp_path / "rows.jsonl"), "--output-dir", str(tmp_path / "o")]) == 1
    error = capsys.readouterr().err
    assert "4 problems in" in error and "give exactly one" not in error, error
    assert "row 1: text is empty\n" in error and "row 3: text is empty\n" in error
    assert "row 2: text is empty (only white space)" in error and "row 4 (id row4): text contains" in error

    (tmp_path / "jobs.jsonl").write_text("".join(json.dumps({"id": f"a{index}", **row}) + "\n"
                                                 for index, row in enumerate(rows[:4])))
    assert cli.main([*FLAGS, "--manifest", str(tmp_path / "jobs.jsonl"), "--output-dir", str(tmp_path / "o")]) == 1
    error = capsys.readouterr().err
    assert "3 problems in jobs.jsonl" in error and "jobs.jsonl line 4: text is empty" in error, error
    assert not (tmp_path / "o").exists()


@pytest.fixture
def no_network(monkeypatch):
    """Any connection (the Hub, through any HTTP library) fails the test."""
    def refuse(self, *args, **kwargs):
        pytest.fail(f"a network connection was tried: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.mark.parametrize("source", ["does_not_exist_dir", "./texts", "/no/such/folder", "texts.csv",
                                    "a/b/c", "~/missing", "a/missing"])
def test_a_local_path_that_does_not_exist_is_not_looked_up_on_the_hub(source, tmp_path, monkeypatch, no_network):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()  # "a/b/c" is a path anyway; "a/missing" is one because the folder a is here
    with pytest.raises(ManifestError, match=re.escape(f"no such file or folder {source!r}")):
        load_input_dataset(source)


def test_a_hub_id_is_not_taken_for_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not looks_local("user/texts", {".csv"}) and looks_local("texts", {".csv"})


def test_the_cli_says_no_such_folder_for_a_missing_dataset(tmp_path, monkeypatch, no_network, no_model, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main([*FLAGS, "--dataset", "does_not_exist_dir", "--output-dataset", "out"]) == 1
    error = capsys.readouterr().err
    assert error.startswith("drama3-tts: error: no such file or folder 'does_not_exist_dir'"), error


def test_without_datasets_the_error_names_the_extra(tmp_path, monkeypatch, no_model, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    (tmp_path / "rows.jsonl").write_text('{"text": "Hello."}\n')
    assert cli.main([*FLAGS, "--dataset", str(tmp_path / "rows.jsonl"), "--output-dataset", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == f"drama3-tts: error: {DATASETS_HINT}\n"
    assert "pip install 'transformers-drama3[datasets]'" in DATASETS_HINT


def test_accelerate_starting_one_process_on_a_cpu_is_said(tmp_path, monkeypatch, no_model, capsys):
    """What `accelerate launch --num_processes 2` without --multi_gpu sets on a machine without GPUs: its
    launcher's variables, and no WORLD_SIZE (one process)."""
    (tmp_path / "jobs.jsonl").write_text('{"id": "a", "text": ""}\n')  # refused at once: the note comes first
    command = [*FLAGS, "--manifest", str(tmp_path / "jobs.jsonl"), "--output-dir", str(tmp_path / "o")]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli.main(command) == 1 and ONE_ACCELERATE_PROCESS not in capsys.readouterr().err
    for name, value in (("ACCELERATE_MIXED_PRECISION", "no"), ("ACCELERATE_USE_CPU", "False"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    assert cli.main(command) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"note: {ONE_ACCELERATE_PROCESS}\n") and "--multi_gpu" in error


def test_a_100_kb_text_is_split_with_progress_over_its_chunks(tmp_path):
    """A 100 kB row is accepted and spoken chunk by chunk: while the job's bar stays at 0/1 items, a second bar
    counts the row's chunks (all of them would take minutes on a CPU: the test stops the job by Ctrl-C once the
    bar has moved, which ends it with one line and status 130)."""
    sentence = "The quick brown fox jumps over the lazy dog, and then it runs back home. "
    text = (sentence * (100_000 // len(sentence) + 1))[:100_000]
    chunks = len(Drama3Processor.from_pretrained(GOLDEN_TINY).split_text(text, max_bytes=300))
    (tmp_path / "rows.jsonl").write_text(json.dumps({"text": text}) + "\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "transformers_drama3.cli", *FLAGS, "--dataset", str(tmp_path / "rows.jsonl"),
         "--output-dataset", str(tmp_path / "out")], stderr=subprocess.PIPE, preexec_fn=default_sigint,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen = b""
    while not re.search(rb" ([2-9]|\d\d+)/%d \[" % chunks, seen):  # the chunk bar past its second chunk
        more = os.read(process.stderr.fileno(), 4096)
        assert more, seen.decode()[-2000:]
        seen += more
    process.send_signal(signal.SIGINT)
    rest = process.communicate(timeout=120)[1].decode()
    assert process.returncode == 130 and "\ndrama3-tts: interrupted\n" in rest and "Traceback" not in rest, rest
    assert re.search(rb" 0/1 \[", seen) and chunks > 300  # the item bar, and a text of many chunks
