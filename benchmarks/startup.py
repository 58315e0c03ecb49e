"""Start-up time: `import transformers_drama3`, `drama3-tts --help`, a usage error and `drama3-prepare --help`,
against a bare `import transformers`, each in a fresh interpreter.

The commands run interleaved, `--repeats` rounds, and the median wall time of each is reported with its ratio to
`import transformers` measured in the same rounds (so a busy machine slows all of them alike). `--before SRC` adds
the same commands for another source tree (e.g. an older commit's `src/`, unpacked with `git archive`), run with this
interpreter and that tree first on `PYTHONPATH`.

    python benchmarks/startup.py --repeats 7
    git archive 0984822 src | tar -x -C /tmp/before && python benchmarks/startup.py --before /tmp/before/src
    python benchmarks/startup.py --only "drama3-prepare --help" --before /tmp/before/src
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

COMMANDS = {
    "import transformers": ["-c", "import transformers"],
    "import transformers_drama3": ["-c", "import transformers_drama3"],
    "drama3-tts --help": ["-c", "import sys; sys.argv = ['drama3-tts', '--help']; "
                                "from transformers_drama3.cli import main; main()"],
    "drama3-tts usage error": ["-c", "import sys; sys.argv = ['drama3-tts', '--tiny', 'Hi']; "
                                     "from transformers_drama3.cli import main; main()"],
    "import + AutoModel (registered)": ["-c", "import transformers_drama3; from transformers import AutoModel"],
    "drama3-prepare --help": ["-c", "import sys; sys.argv = ['drama3-prepare', '--help']; "
                                    "from transformers_drama3.training.cli import main; main()"],
}


def timed(arguments: list[str], source: str | None) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if source is not None:
        env["PYTHONPATH"] = source + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    subprocess.run([sys.executable, *arguments], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5); medians are reported")
    parser.add_argument("--before", help="another source tree (its src/ directory) to measure the same way")
    parser.add_argument("--only", nargs="+", metavar="COMMAND", default=[],
                        help="measure only these commands (and `import transformers`, the baseline)")
    args = parser.parse_args()

    commands = {name: arguments for name, arguments in COMMANDS.items()
                if not args.only or name in args.only or name == "import transformers"}
    runs = [(name, arguments, None) for name, arguments in commands.items()]
    if args.before:
        runs += [(f"{name} [before]", arguments, args.before) for name, arguments in commands.items()
                 if name != "import transformers"]
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for _ in range(args.repeats):
        for name, arguments, source in runs:
            times[name].append(timed(arguments, source))

    baseline = statistics.median(times["import transformers"])
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, {args.repeats} rounds")
    print(f"{'command':<46} {'median s':>9} {'x import transformers':>22}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<46} {median:>9.2f} {median / baseline:>22.2f}")


if __name__ == "__main__":
    main()
