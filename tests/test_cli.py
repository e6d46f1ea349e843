"""The `tokenloop` command, run in-process on the tiny model folder (and the store listing)."""

from __future__ import annotations

import io
import re

import pytest

from tokenloop.cli import main


def test_generate_streams_text_and_prints_stats(tiny_model_folder, capsys):
    args = ["generate", "Hello world", "--model", str(tiny_model_folder), "--dtype", "float32", "--max-tokens", "6"]
    assert main(args + ["--stats"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "decode: 6 tokens" in err and "prompt: " in err


def test_generate_with_a_seed_is_reproducible(tiny_model_folder, capsys):
    args = [
        "generate",
        "Hello",
        "--model",
        str(tiny_model_folder),
        "--temperature",
        "1",
        "--seed",
        "7",
        "--max-tokens",
        "8",
    ]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first


def test_chat_answers_each_turn_and_reuses_the_cache(tiny_model_folder, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello world! Hello tokenizers, hello templates.\nAnd then?\n/exit\n"))
    assert main(["chat", "--model", str(tiny_model_folder), "--max-tokens", "5", "--stats"]) == 0
    err = capsys.readouterr().err
    stats = [line for line in err.splitlines() if line.startswith("prompt:")]
    assert len(stats) == 2
    assert "(0 cached)" in stats[0] and "(0 cached)" not in stats[1]


def test_unknown_model_is_an_error_listing_known_models(capsys):
    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    assert "known models: gemma3-270m, smollm2-135m-instruct" in capsys.readouterr().err


def test_bad_sampling_value_names_the_field(tiny_model_folder, capsys):
    assert main(["generate", "hi", "--model", str(tiny_model_folder), "--top-p", "1.5"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_models_lists_the_default_and_gemma3(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct (default)" in out and "gemma3-270m\n  Gemma 3 270M" in out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_perplexity_prints_the_score_of_a_file(tiny_model_folder, tmp_path, capsys, kv_cache_dtype):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    args = ["perplexity", str(text), "--model", str(tiny_model_folder), "--window", "32"]
    assert main([*args, "--kv-cache-dtype", kv_cache_dtype]) == 0
    out = capsys.readouterr().out
    settings = rf"window 32, dtype auto, KV cache {kv_cache_dtype}"
    assert re.fullmatch(rf"perplexity \d+\.\d{{3}} over \d+ tokens \({settings}\) in \d+\.\d s\n", out)


def test_perplexity_of_a_missing_file_is_a_clean_error(tmp_path, capsys):
    assert main(["perplexity", str(tmp_path / "missing.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot read") and "missing.txt" in err and "Traceback" not in err


def test_a_first_generate_says_what_it_waits_for_on_stderr_and_prints_only_text_on_stdout(tiny_model_folder, tmp_path):
    """An empty package cache: the command runs eager at once, says on stderr that it compiles in the background,
    leaves only the generated text in its stdout file; the compile outlives it, and the next start uses it."""
    import os
    import shutil
    import subprocess
    import sys
    import time

    from tokenloop.models.store import tokenloop_home

    home = tmp_path / "home"
    if (tokenloop_home() / "kernels").is_dir():  # the kernels' own 20-80 s build is not what this test is about
        shutil.copytree(tokenloop_home() / "kernels", home / "kernels")
    env = os.environ | {"TOKENLOOP_HOME": str(home), "TOKENLOOP_COMPILE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "tokenloop.cli",
        "generate",
        "Hello world",
        "--model",
        str(tiny_model_folder),
        "--dtype",
        "float32",
        "--max-tokens",
        "6",
        "-t",
        "0",
    ]
    with open(tmp_path / "out.txt", "w") as out:
        first = subprocess.run(cmd, stdout=out, stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    assert "compiling the decode step in the background" in first.stderr
    text = (tmp_path / "out.txt").read_text()
    again = subprocess.run(cmd + ["--no-compile"], capture_output=True, text=True, env=env, timeout=300)
    assert text == again.stdout and text.endswith("\n") and "tokenloop:" not in text  # the text, and nothing else

    (log,) = (home / "compiled").glob("*.log")
    deadline = time.monotonic() + 300
    while "built " not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(1)
    later = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert later.returncode == 0 and later.stdout == text and "compiling" not in later.stderr


def test_generate_takes_every_logits_processor_as_a_flag(tiny_model_folder, capsys):
    from tokenloop import LLM, SamplingParams

    args = [
        "generate",
        "Hello world",
        "--model",
        str(tiny_model_folder),
        "--dtype",
        "float32",
        "--max-tokens",
        "6",
        "-t",
        "0",
    ]
    assert main(args + ["--logit-bias", "7=100", "--repetition-penalty", "1", "--no-repeat-ngram-size", "0"]) == 0
    token = LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01).get_tokenizer().decode([7] * 6)
    assert capsys.readouterr().out == token + "\n"
    assert main(args + ["--logit-bias", "7:100"]) == 2 and "--logit-bias takes TOKEN_ID=BIAS" in capsys.readouterr().err
    assert main(args + ["--min-tokens", "9"]) == 2 and "min_tokens" in capsys.readouterr().err
    assert SamplingParams().repetition_penalty == 1.0  # the API's defaults stay neutral; only the CLI's are tuned


def test_ctrl_c_during_a_chat_reply_stops_that_reply_and_the_chat_goes_on(tiny_model_folder, capsys, monkeypatch):
    from tokenloop import cli
    from tokenloop.engine import streaming

    engines, real_stream = [], streaming.stream

    def interrupted_first_reply(engine, prompt, params, stats):
        engines.append(engine)
        for i, delta in enumerate(real_stream(engine, prompt, params, stats)):
            if len(engines) == 1 and i == 1:
                raise KeyboardInterrupt  # as Ctrl-C lands in the reply's loop
            yield delta

    monkeypatch.setattr(streaming, "stream", interrupted_first_reply)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nAnd then?\n/exit\n"))
    assert (
        cli.main(["chat", "--model", str(tiny_model_folder), "--max-tokens", "8", "--min-tokens", "8", "--stats"]) == 0
    )
    err = capsys.readouterr().err
    assert "[stopped]" in err and len(engines) == 2 and not engines[0].has_unfinished_requests()
    stats = [line for line in err.splitlines() if line.startswith("prompt:")]
    assert (
        len(stats) == 2 and "decode: 8 tokens" not in stats[0] and "decode: 8 tokens" in stats[1]
    )  # the next turn, whole


def test_generate_strategy_beam_prints_the_best_beam_and_vote_prints_the_winner(
    tiny_model_folder, long_context_model_folder, capsys
):
    from tokenloop import LLM, BeamSearchParams

    best = LLM(tiny_model_folder, dtype="float32", device="cpu", kv_cache_gb=0.01).beam_search(
        "Hello", BeamSearchParams(beam_width=3, max_tokens=6)
    )[0]
    assert (
        main(
            [
                "generate",
                "Hello",
                "--model",
                str(tiny_model_folder),
                "--dtype",
                "float32",
                "--strategy",
                "beam",
                "--beam-width",
                "3",
                "--max-tokens",
                "6",
                "--no-compile",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == best.outputs[0].text + "\n"
    assert (
        main(
            [
                "generate",
                "Hi",
                "--model",
                str(long_context_model_folder),
                "--strategy",
                "vote",
                "--n",
                "4",
                "--answer",
                "([a-z])",
                "--max-tokens",
                "8",
                "--seed",
                "1",
                "--no-compile",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "votes (" in captured.err and len(captured.out.strip()) <= 1
    assert (
        main(
            [
                "generate",
                "Hi",
                "--model",
                str(tiny_model_folder),
                "--strategy",
                "vote",
                "--answer",
                "no group",
                "--no-compile",
            ]
        )
        == 2
    )
    assert "answer" in capsys.readouterr().err
