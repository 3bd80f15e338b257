"""The names a request's `model` may give the base model (GatewayState.check_model, BaseModelNames): without
--served-model-name, vLLM's (--model as typed: init_app_state's `served_model_names = args.served_model_name or
[args.model]`) and SGLang's ("default", its protocol's DEFAULT_MODEL_NAME; it checks `model` against nothing)
besides Shoal's own (the folder's last part, which responses still carry); with it, only the served names (vLLM's
_is_model_supported). In process (the Engine knows its folder) and on Ray (a client that does not: looked up
from --model-path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.config import ServerArgs
from runtime.gateway.errors import ApiError
from runtime.gateway.state import GatewayState
from runtime.model_names import SGLANG_DEFAULT_MODEL, BaseModelNames


class _Client:
    """The EngineClient surface check_model reads: an in-process Engine's (model_path: the folder it loaded)
    or, with model_path None, a RayEngineClient's (which does not know it)."""

    def __init__(self, model_name: str, model_path: str | None):
        self.model_name, self.model_path = model_name, model_path

    def stream(self, *_a, **_k):  # marks a ready client for GatewayState, never called here
        raise AssertionError

    def is_ready(self) -> bool:
        return True

    def lora_adapters(self) -> dict[str, str]:
        return {}


def _state(client: _Client, **args) -> GatewayState:
    return GatewayState(client, ServerArgs(**args))


def _refused(state: GatewayState, client: _Client, model: str) -> str:
    with pytest.raises(ApiError) as ei:
        state.check_model(client, model)
    assert ei.value.status == 404 and ei.value.code == "model_not_found" and ei.value.param == "model"
    return ei.value.message


def test_the_path_as_typed_the_folder_and_default_name_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    typed = "models/tiny/"  # relative, with the slash the shell completed
    client = _Client("tiny", typed)
    state = _state(client, model_path=typed)
    for model in (None, "tiny", typed, str(tmp_path / "models" / "tiny"), SGLANG_DEFAULT_MODEL):
        assert state.check_model(client, model) == "tiny", model  # responses still carry Shoal's name
    for other in ("models/tiny", "tiny/", "Default", "models", "/models/tiny"):
        assert "This server serves `tiny`." in _refused(state, client, other)


def test_a_served_name_keeps_vllms_rule(tmp_path):
    folder = str(tmp_path / "llama")
    client = _Client("a", folder)
    state = _state(client, model_path=folder, served_model_name="a", served_model_aliases=("b",))
    assert [state.check_model(client, m) for m in ("a", "b", None)] == ["a", "a", "a"]
    for other in (folder, SGLANG_DEFAULT_MODEL, "llama"):
        assert "This server serves `a`, `b`." in _refused(state, client, other)


def test_a_ray_client_names_the_cached_snapshot_of_a_repo_id(tmp_path, monkeypatch):
    """A RayEngineClient knows no folder: the gateway (a GatewayActor, given ServerArgs) finds the snapshot
    --model-path's repo id resolves to in its own HF cache, and never downloads or fails for one it lacks."""
    snapshot = tmp_path / "hub" / "models--Org--Tiny" / "snapshots" / ("c" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("c" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    client = _Client("Tiny", None)
    state = _state(client, model_path="Org/Tiny")
    for model in ("Org/Tiny", str(snapshot), "Tiny", SGLANG_DEFAULT_MODEL):
        assert state.check_model(client, model) == "Tiny", model
    assert "`Tiny`" in _refused(state, client, "Org/Other")
    # not cached: only the name as typed (and the gateway still starts)
    assert BaseModelNames.of("Org/Missing").names == {"Org/Missing", SGLANG_DEFAULT_MODEL}


def test_the_default_model_is_named_by_its_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path))
    folder = str(tmp_path / "SmolLM2-135M-Instruct")
    names = BaseModelNames.of(None)  # a Ray client, no --model-path: looked up, never built
    assert names.names == {folder, SGLANG_DEFAULT_MODEL}
    client = _Client("SmolLM2-135M-Instruct", folder)
    state = _state(client)
    assert state.check_model(client, folder) == state.check_model(client, "default") == "SmolLM2-135M-Instruct"


def test_an_adapter_named_default_wins(tmp_path, monkeypatch):
    folder = str(tmp_path / "llama")
    client = _Client("llama", folder)
    state = _state(client, model_path=folder)
    monkeypatch.setattr(GatewayState, "lora_adapters", property(lambda self: {"default": "/p/ad"}))
    assert state.check_model(client, "default") == "default"  # the adapter, as before
    assert state.lora_name("default") == "default"
    assert state.check_model(client, folder) == "llama"


def test_names_compare_exactly(tmp_path):
    folder = tmp_path / "llama"
    names = BaseModelNames.of(str(folder))
    assert str(folder) in names and os.path.abspath(folder) in names and Path(folder) not in names
    assert str(folder).upper() not in names and None not in names


def test_a_ray_gateway_looks_the_repo_up_once_per_client(tmp_path, monkeypatch):
    """The HF cache walk behind a Ray client's names runs once per client, not on the event loop for every
    request naming the repo id or "default"; at --revision's snapshot."""
    from runtime.hf_cache import HfCache

    repo = tmp_path / "hub" / "models--Org--Tiny"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    (repo / "refs" / "v2").write_text("b" * 40)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    looked: list[str | None] = []
    snapshot = HfCache.snapshot
    monkeypatch.setattr(HfCache, "snapshot", lambda self, r, rev=None: looked.append(rev) or snapshot(self, r, rev))
    client = _Client("Tiny", None)
    state = _state(client, model_path="Org/Tiny", revision="v2")
    for model in ("Org/Tiny", SGLANG_DEFAULT_MODEL, str(repo / "snapshots" / ("b" * 40))) * 3:
        assert state.check_model(client, model) == "Tiny", model
    assert "`Tiny`" in _refused(state, client, str(repo / "snapshots" / ("a" * 40)))  # main's: not served
    assert looked == ["v2"]
    other = _Client("Tiny", None)  # a new client (the gateway's provider swapped it): looked up again
    state.check_model(other, SGLANG_DEFAULT_MODEL)
    assert looked == ["v2", "v2"]
