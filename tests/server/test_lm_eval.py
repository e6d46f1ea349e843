"""lm-evaluation-harness against the server, unchanged: its `local-completions` finds the tokenizer routes by itself
(offline: no tokenizer is loaded by the model's name) and runs a multiple-choice, a generate-until and a
loglikelihood-rolling task over local JSONL files. On `--dtype float32` every example's loglikelihood equals
lm-eval's own `hf` backend on the same GGUF (transformers) within 1e-3, and the scores are equal; on the default
path the results are the same whatever `num_concurrent` is."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.server.conftest import MODEL_NAME, start_server, stop_server

for flag in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # local JSONL only: nothing is fetched
    os.environ.setdefault(flag, "1")
lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.real_model

QUESTIONS = [
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a dog have?", ["two", "four", "six", "eight"], 1),
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], 2),
    ("Which animal says moo?", ["cat", "dog", "duck", "cow"], 3),
    ("What do bees make?", ["honey", "milk", "silk", "wool"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("What is two plus two?", ["three", "five", "six", "four"], 3),
]
ARITHMETIC = [("2 + 3", "5"), ("10 - 4", "6"), ("3 * 3", "9"), ("7 + 1", "8"), ("12 / 4", "3"), ("9 - 9", "0")]
TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny afternoon and the fox had nothing better to do.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and water.",
    "In 1969, astronauts landed on the Moon for the first time, and millions watched the event on television.",
    "To bake bread you need flour, water, salt and yeast; the dough rises before it goes into a hot oven.",
]

TASKS = {
    "tl_choice": {
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "target_delimiter": " ",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    },
    "tl_generate": {
        "output_type": "generate_until",
        "doc_to_text": "Compute: {{question}} =",
        "doc_to_target": " {{answer}}",
        "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False, "temperature": 0},
        "metric_list": [{"metric": "exact_match", "regexes_to_ignore": [" "]}],
    },
    "tl_rolling": {
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"}, {"metric": "bits_per_byte"}],
    },
}
ROWS = {
    "tl_choice": [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS],
    "tl_generate": [{"question": q, "answer": a} for q, a in ARITHMETIC],
    "tl_rolling": [{"text": t} for t in TEXTS],
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The three tasks as lm-eval YAML configs over local JSONL files (JSON is YAML)."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, config in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in ROWS[name]))
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
        } | config
        (folder / f"{name}.yaml").write_text(json.dumps(config))
    return folder


def evaluate(task_dir: Path, model: str, model_args: str) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def served(task_dir: Path, server, **extra) -> dict:
    args = {"base_url": f"{server.url}/v1/completions", "model": MODEL_NAME, "max_retries": 1} | extra
    return evaluate(task_dir, "local-completions", ",".join(f"{k}={v}" for k, v in args.items()))


def per_example(results: dict) -> dict[str, list]:
    """Each task's per-example responses in document order: (loglikelihood, is_greedy) per choice, a rolling
    loglikelihood, or the generated text."""
    return {
        task: [s["filtered_resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
        for task, samples in results["samples"].items()
    }


def scores(results: dict) -> dict[str, dict[str, float]]:
    return {
        task: {k: v for k, v in metrics.items() if isinstance(v, float) and not k.endswith("_stderr,none")}
        for task, metrics in results["results"].items()
    }


def loglikelihoods(responses: list) -> list[float]:
    flat = []
    for r in responses:
        for item in r:
            flat.append(float(item[0] if isinstance(item, list | tuple) else item))
    return flat


@pytest.fixture(scope="module")
def fp32_server(default_model_path, tmp_path_factory):
    s = start_server(
        default_model_path,
        tmp_path_factory.mktemp("lm_eval") / "server.log",
        "--dtype",
        "float32",
        "--kv-cache-gb",
        "0.25",
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def hf_results(task_dir, default_model_path) -> dict:
    folder, name = default_model_path.parent, default_model_path.name
    return evaluate(task_dir, "hf", f"pretrained={folder},gguf_file={name},dtype=float32,device=cpu,batch_size=1")


def test_remote_tokenizer_is_detected_offline(fp32_server):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(base_url=f"{fp32_server.url}/v1/completions", model=MODEL_NAME)
    assert lm.tokenizer_backend == "remote"
    text = "Question: What do bees make?\nAnswer: honey"
    ids = lm.tok_encode(text)
    assert lm.decode_batch([ids]) == [text]
    assert lm.eot_token_id == 2 and lm.prefix_token_id == 1  # <|im_end|>, <|im_start|>


def test_float32_matches_the_hf_backend_example_by_example(task_dir, fp32_server, hf_results):
    ours = served(task_dir, fp32_server)
    theirs, mine = per_example(hf_results), per_example(ours)
    for task in ("tl_choice", "tl_rolling"):
        a, b = loglikelihoods(mine[task]), loglikelihoods(theirs[task])
        assert len(a) == len(b) == sum(len(x) for x in mine[task])
        worst = max(abs(x - y) for x, y in zip(a, b))
        print(f"{task}: {len(a)} loglikelihoods, largest difference {worst:.2e}")
        assert worst <= 1e-3, (task, a, b)
    assert mine["tl_generate"] == theirs["tl_generate"]
    ours_scores, hf_scores = scores(ours), scores(hf_results)
    print("tokenloop:", ours_scores, "\nhf:", hf_scores)
    assert ours_scores["tl_choice"] == hf_scores["tl_choice"]
    assert ours_scores["tl_generate"] == hf_scores["tl_generate"]
    for metric, value in hf_scores["tl_rolling"].items():
        assert math.isclose(ours_scores["tl_rolling"][metric], value, rel_tol=1e-4), metric


def test_default_path_results_do_not_depend_on_num_concurrent(task_dir, real_server):
    one = served(task_dir, real_server, num_concurrent=1)
    many = served(task_dir, real_server, num_concurrent=4, batch_size=3)
    assert per_example(one) == per_example(many)
    assert scores(one) == scores(many)
