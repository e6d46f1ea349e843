"""`--record` keeps each run's report with its date, commit, CPU and command, and writes the docs from them."""

from __future__ import annotations

import json
import subprocess

from tokenloop.bench import record

README = "# tokenloop\n\nintro\n\n<!-- bench:start -->\nold table\n<!-- bench:end -->\n\n## More\n"


def checkout(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "README.md").write_text(README)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x"],
        cwd=tmp_path,
        check=True,
    )
    return tmp_path


def test_each_run_is_appended_and_the_docs_show_the_newest_first(tmp_path, monkeypatch):
    root = checkout(tmp_path)
    monkeypatch.setattr("sys.argv", ["tokenloop", "bench", "--engines", "tokenloop,llama-bench", "--record"])
    record.save("offline", "first table", root)
    record.save("serve", "serve report", root)
    record.save("offline", "second table", root)

    rows = [json.loads(line) for line in (root / "benchmarks/results/offline.jsonl").read_text().splitlines()]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    assert [r["report"] for r in rows] == ["first table", "second table"]
    assert (
        rows[0]["commit"] == commit and rows[0]["command"] == "tokenloop bench --engines tokenloop,llama-bench --record"
    )
    assert rows[0]["cpu"] and rows[0]["date"].endswith("UTC")

    docs = (root / "docs/benchmarks.md").read_text()
    assert docs.index("second table") < docs.index("first table") and "serve report" in docs
    readme = (root / "README.md").read_text()
    assert (  # one table: the newest offline run; the others are in docs/benchmarks.md
        "second table" in readme
        and "serve report" not in readme
        and "first table" not in readme
        and "old table" not in readme
    )
    assert readme.startswith("# tokenloop\n\nintro\n\n<!-- bench:start -->") and readme.endswith(
        "<!-- bench:end -->\n\n## More\n"
    )


def test_a_tree_that_differs_from_its_commit_says_so(tmp_path):
    root = checkout(tmp_path)
    (root / "pyproject.toml").write_text("changed")
    subprocess.run(["git", "add", "pyproject.toml"], cwd=root, check=True)
    record.save("offline", "table", root)
    assert json.loads((root / "benchmarks/results/offline.jsonl").read_text())["commit"].endswith("+changes")


def test_what_record_writes_does_not_count_as_a_change(tmp_path):
    root = checkout(tmp_path)
    subprocess.run(["git", "add", "README.md"], cwd=root, check=True)
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "readme"], cwd=root, check=True
    )
    record.save("offline", "table", root)  # rewrites the README's table
    record.save("serve", "report", root)
    assert not json.loads((root / "benchmarks/results/serve.jsonl").read_text())["commit"].endswith("+changes")


def test_the_readme_shows_the_default_models_newest_run_not_another_models(tmp_path, monkeypatch):
    root = checkout(tmp_path)
    monkeypatch.setattr("sys.argv", ["tokenloop", "bench", "--record"])
    record.save("offline", "default model table", root)
    monkeypatch.setattr("sys.argv", ["tokenloop", "bench", "--model", "gemma3-270m", "--record"])
    record.save("offline", "gemma table", root)
    readme, docs = (root / "README.md").read_text(), (root / "docs/benchmarks.md").read_text()
    assert "default model table" in readme and "gemma table" not in readme
    assert docs.index("gemma table") < docs.index("default model table")  # the docs keep every run, newest first
