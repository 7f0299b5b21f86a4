"""The README's commands, as a newcomer copies them: every `bin/ddtree` line parses and passes the CLI's
checks, and those that run on the CPU run here on the default pair (with fewer tokens, so that the suite
stays quick; each shortening is asserted, so an edited README fails here instead of drifting)."""
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from ddtree.cli import build_parser, check_mode_args, check_serve_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def commands() -> list[str]:
    """Every shell command of the README's bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in blocks("bash"):
        line = ""
        for part in block.replace("\\\n", " ").splitlines():
            line += part + "\n"
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # a quotation that goes on over the next line
                continue
            if words:
                out.append(" ".join(shlex.quote(w) for w in words if w != "&"))
            line = ""
    return out


def shortened(text: str, old: str, new: str) -> str:
    assert old in text, f"the README no longer says {old!r}: update this test with it"
    return text.replace(old, new)


def test_every_ddtree_command_in_the_readme_parses_and_passes_its_checks():
    from ddtree import SamplingParams
    lines = [c for c in commands() if c.startswith("bin/ddtree ")]
    assert len(lines) >= 10
    for line in lines:
        args = build_parser().parse_args(shlex.split(line)[1:])  # (argparse exits on an unknown option)
        if args.command == "serve":
            check_serve_args(args)
        elif args.command == "generate":
            check_mode_args(args)
            SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def test_the_first_command_answers_on_the_cpu():
    (line,) = [c for c in commands() if c.startswith("bin/ddtree generate 'Write a Python function")]
    argv = shlex.split(line)[1:] + ["--max-tokens", "8"]
    r = subprocess.run([sys.executable, "-m", "ddtree.cli", *argv], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_the_python_example_runs_on_the_default_pair():
    from ddtree.models.hub import default_draft
    (code,) = [b for b in blocks("python") if "from ddtree import" in b]
    code = shortened(code, '"path/to/dflash_drafter"', repr(default_draft()))
    code = shortened(code, "max_tokens=128", "max_tokens=8")
    code = shortened(code, "SamplingParams(temperature=0.7", "SamplingParams(max_tokens=8, temperature=0.7")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    accepts = eval(r.stdout.strip().splitlines()[-1])  # print(outs[0].accept_lengths)
    assert accepts and all(n >= 0 for n in accepts)


def test_the_serving_examples_answer_curl_and_the_openai_client(tmp_path):
    from test_server import STARTUP_S, launch, wait_healthy
    (serve,) = [c for c in commands() if c.startswith("bin/ddtree serve --spec ddtree") and "sekrit" in c]
    server = launch("readme", shlex.split(serve)[2:], tmp_path)
    port = server.url.rsplit(":", 1)[1]
    try:
        wait_healthy(server, time.monotonic() + STARTUP_S)
        for curl in [c for c in commands() if c.startswith("curl ")]:
            curl = shortened(curl, "localhost:8000", f"localhost:{port}").replace('"max_tokens": 128', '"max_tokens": 8')
            r = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=120)
            assert r.returncode == 0 and '"error"' not in r.stdout, r.stdout + r.stderr
            assert '"status": "ok"' in r.stdout.replace('":"', '": "') or '"choices"' in r.stdout, r.stdout
        (code,) = [b for b in blocks("python") if "from openai import OpenAI" in b]
        code = shortened(code, "127.0.0.1:8000", f"127.0.0.1:{port}")
        code = shortened(code, "stream=True,", "stream=True, max_tokens=8,")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=30)


@pytest.mark.parametrize("line", ["bin/ddtree serve --spec ddtree --budget 0", "bin/ddtree serve --model /x --spec dflash"])
def test_the_checks_refuse_what_cannot_work(line):
    with pytest.raises(ValueError):
        check_serve_args(build_parser().parse_args(shlex.split(line)[1:]))
