"""A Hugging Face repo id as --model-path, served from the local HF cache (hf_cache.py, through resolve_model: the
Engine's, the Ray launcher's and PoolingConfig's one lookup) and never downloaded: a tiny model laid out as
huggingface_hub caches one (models--Org--Name/{blobs,refs/main,snapshots/<commit>} with symlinks to blobs) under
HF_HOME answers greedy as HF does on the same weights; a repo id the cache lacks fails the start, naming
--model-path and the folder looked in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hf_cache_dirs import cache_repo, hf_home_env
from tiny_models import hf_greedy_ids

from runtime.config import ServerArgs
from runtime.default_model import resolve_model
from runtime.errors import ServerArgsError
from runtime.hf_cache import HfCache, local_model_folder

REPO = "Org/Tiny"
COMMIT = "a" * 40
OLD_COMMIT = "b" * 40
PROMPT = [5, 17, 42, 99, 7]


def _cache(hub: Path, model: Path) -> Path:
    """hub/models--Org--Tiny as huggingface_hub writes it (blobs linked from the snapshots): refs/main names
    COMMIT, and an older snapshot (OLD_COMMIT) lies beside it, without config.json to tell the two apart."""
    repo = cache_repo(hub, REPO, {COMMIT: model, OLD_COMMIT: model}, {"main": COMMIT})
    (repo / "snapshots" / OLD_COMMIT / "config.json").unlink()
    return repo


@pytest.fixture(scope="module")
def hf_home(tiny_llama, tmp_path_factory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("hf_home")
    _cache(home / "hub", tiny_llama)
    with hf_home_env(home):
        yield home


@pytest.fixture(scope="module")
def engine(hf_home):
    from runtime import Engine

    with Engine(REPO, device="cpu", dtype="float32", max_total_tokens=512, log_level="warning") as engine:
        yield engine


def test_a_cached_repo_id_serves_greedy_as_hf(engine, hf_home, tiny_llama):
    snapshot = hf_home / "hub" / "models--Org--Tiny" / "snapshots" / COMMIT
    assert engine.model_path == str(snapshot) and engine.model_name == "Tiny"  # the repo's name, not the commit
    out = engine.generate(input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 8})
    assert out["output_ids"] == hf_greedy_ids(tiny_llama, PROMPT, 8)
    text = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 4})
    assert isinstance(text["text"], str)  # the tokenizer loaded from the snapshot too


def test_a_vllm_client_names_the_repo_id_it_started_the_server_with(engine, hf_home):
    import openai

    from runtime.gateway.server import serve_in_thread

    snapshot = str(hf_home / "hub" / "models--Org--Tiny" / "snapshots" / COMMIT)
    with serve_in_thread(engine, ServerArgs(model_path=REPO), port=0) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for name in (REPO, snapshot, "Tiny", "default"):
            r = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0)
            assert r.model == "Tiny" and r.choices[0].text is not None, name
        assert [m.id for m in client.models.list().data] == ["Tiny"]
        with pytest.raises(openai.NotFoundError) as ei:
            client.completions.create(model="Org/Other", prompt=PROMPT, max_tokens=1)
        assert ei.value.body["code"] == "model_not_found"


def test_refs_main_picks_the_snapshot_and_a_revision_another(hf_home):
    cache = HfCache.from_env()
    assert cache.root == hf_home / "hub"
    assert cache.snapshot(REPO) == cache.repo_folder(REPO) / "snapshots" / COMMIT
    assert cache.snapshot(REPO, OLD_COMMIT) == cache.repo_folder(REPO) / "snapshots" / OLD_COMMIT
    assert cache.snapshot(REPO, "dev") is None and cache.snapshot("Org/Other") is None
    with pytest.raises(ServerArgsError, match="holds the snapshots") as ei:
        cache.resolve(REPO, "dev")
    assert ei.value.flag == "--model-path" and f"{COMMIT}, {OLD_COMMIT}" in str(ei.value)
    with pytest.raises(ServerArgsError, match="has no config.json"):  # an incomplete snapshot, named as such
        resolve_model(REPO, revision=OLD_COMMIT)


def test_a_repo_id_not_cached_fails_naming_the_cache_and_that_shoal_does_not_download(hf_home):
    from runtime import Engine

    for start in (lambda: resolve_model("Org/Other"), lambda: Engine("Org/Other", device="cpu")):
        with pytest.raises(ServerArgsError) as ei:
            start()
        message = str(ei.value)
        assert ei.value.flag == "--model-path" and "'Org/Other'" in message
        assert "not in the local Hugging Face cache" in message and str(hf_home / "hub") in message
        assert "Shoal does not download models" in message
    with pytest.raises(ServerArgsError, match="nor a valid Hugging Face repo id"):
        resolve_model("Org--x")


def test_pooling_reads_the_snapshot_too(hf_home):
    from runtime.text.pooling_config import PoolingConfig

    assert PoolingConfig.for_server(ServerArgs(model_path=REPO, is_embedding=True)) == PoolingConfig.read(
        hf_home / "hub" / "models--Org--Tiny" / "snapshots" / COMMIT)


def test_a_local_folder_wins_and_paths_pass_through(hf_home, tmp_path, monkeypatch, tiny_llama):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Org").mkdir()
    (tmp_path / "Org" / "Tiny").symlink_to(tiny_llama)
    assert resolve_model(REPO) == (REPO, "Tiny")  # as vLLM and transformers: the folder first
    for path in (str(tmp_path / "missing"), "./missing", "a/b/c"):  # not repo ids: model_config says why
        assert local_model_folder(path) == path


def test_hf_hub_cache_names_the_cache_over_hf_home(hf_home, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert HfCache.from_env().root == tmp_path and HfCache.from_env().snapshot(REPO) is None
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert HfCache.from_env().root == tmp_path / "huggingface" / "hub"


def test_each_ray_node_finds_the_repo_in_its_own_cache(hf_home, tmp_path):
    """A TP rank on another node gets the launcher's snapshot path, which its own cache may lack: it looks the
    repo id up again there; a path that exists, or a local folder given as one, is taken as sent."""
    from runtime.cluster.tp_rank import local_model_path

    snapshot = hf_home / "hub" / "models--Org--Tiny" / "snapshots" / COMMIT
    args = ServerArgs(model_path=REPO)
    assert local_model_path(args, str(tmp_path / "launcher-node" / "snapshot")) == str(snapshot)
    assert local_model_path(args, str(snapshot)) == str(snapshot)
    folder = ServerArgs(model_path=str(tmp_path))
    assert local_model_path(folder, str(tmp_path)) == str(tmp_path)
    with pytest.raises(ServerArgsError) as e:
        local_model_path(ServerArgs(model_path="Org/Absent"), "/elsewhere/snapshot")
    assert e.value.flag == "--model-path"


def test_a_home_relative_folder_is_expanded(tmp_path, monkeypatch):
    """`--model-path=~/m` and a YAML config's `model: ~/m` reach Shoal unexpanded (no shell expands them)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    assert local_model_folder("~/m") == str(tmp_path / "m")
    assert local_model_folder(str(tmp_path / "m")) == str(tmp_path / "m")
