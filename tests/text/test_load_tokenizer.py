"""load_tokenizer: a tokenizer path that cannot be loaded (a typo, a folder without tokenizer files,
broken files) fails the start with ServerArgsError("--tokenizer-path") and a one-line reason; only a
model folder that holds no tokenizer at all serves token ids with the NullTokenizer. Also the chat
template's extras: template kwargs, continue_final_message, reserved kwargs refused."""

from __future__ import annotations

import shutil

import pytest

from runtime import Engine
from runtime.errors import InvalidRequestError, ServerArgsError
from runtime.text.tokenizer import NullTokenizer, Tokenizer, load_tokenizer


@pytest.fixture()
def bare_model(tiny_llama, tmp_path):
    """A model folder without tokenizer files (benchmarks: config.json and weights)."""
    folder = tmp_path / "bare"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama / name, folder / name)
    return folder


def _fails(path, explicit=None) -> str:
    with pytest.raises(ServerArgsError) as e:
        load_tokenizer(path, (), None, explicit=explicit)
    assert e.value.flag == "--tokenizer-path" and "\n" not in str(e.value)
    return str(e.value)


def test_a_missing_path_fails_naming_the_flag(tmp_path):
    why = _fails(tmp_path / "tokenzier-typo")
    assert why.startswith("--tokenizer-path: ") and "tokenzier-typo" in why


def test_a_folder_without_tokenizer_files_that_is_no_model_fails(tmp_path):
    (tmp_path / "notes.txt").write_text("not a tokenizer")
    assert "holds no tokenizer files" in _fails(tmp_path)


def test_broken_tokenizer_files_fail(tiny_llama, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama, folder)
    (folder / "tokenizer.json").write_text("{ not json")
    assert "does not load" in _fails(folder)


def test_only_a_model_folder_without_tokenizer_gets_the_null_tokenizer(bare_model):
    assert isinstance(load_tokenizer(bare_model, (7,)), NullTokenizer)
    assert isinstance(load_tokenizer(bare_model, (7,), explicit=False), NullTokenizer)
    _fails(bare_model, explicit=True)  # the operator named it as the tokenizer: it has none


def test_a_good_path_loads(tiny_llama):
    assert isinstance(load_tokenizer(tiny_llama, (), explicit=True), Tokenizer)


def test_engine_start_fails_on_a_bad_tokenizer_path(tiny_llama, tmp_path):
    with pytest.raises(ServerArgsError, match="--tokenizer-path"):
        Engine(str(tiny_llama), device="cpu", max_total_tokens=256, tokenizer_path=str(tmp_path / "nope"))


def test_template_kwargs_and_continue_final_message(tiny_llama):
    tok = Tokenizer(tiny_llama, chat_template=(
        "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{% if shout %}!{% endif %}"
        "{% if add_generation_prompt %}[assistant:{% endif %}"))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == "[user:hi][assistant:"
    assert tok.render_chat(msgs, template_kwargs={"shout": True}) == "[user:hi]![assistant:"
    assert tok.render_chat(msgs, add_generation_prompt=False) == "[user:hi]"
    cont = msgs + [{"role": "assistant", "content": "Par"}]
    assert tok.render_chat(cont, add_generation_prompt=False, continue_final_message=True) == "[user:hi][assistant:Par"
    assert tok.decode(tok.apply_chat_template(msgs, template_kwargs={"shout": True})) == "[user:hi]![assistant:"
    for key in ("tokenize", "return_dict", "messages", "add_generation_prompt"):
        with pytest.raises(InvalidRequestError, match=key) as e:
            tok.render_chat(msgs, template_kwargs={key: True})
        assert e.value.param == "chat_template_kwargs"


def test_one_truncating_copy_held_by_one_thread_at_a_time(tiny_llama):
    """Truncation is a setting of the Rust tokenizer: a worker lane and a caller of Engine.score setting it on one
    copy at once would fail ("Already borrowed"), so the copy (never hf itself: the loop encodes with it) is held
    under a lock; one copy, not one per thread (a large vocabulary's is ~60 MB)."""
    import threading

    tok = Tokenizer(tiny_llama)
    with tok.truncating() as mine:
        assert mine is tok.truncating_hf and mine is not tok.hf
        other: list = []
        t = threading.Thread(target=lambda: other.append(tok.truncating_lock.acquire(timeout=0.05)))
        t.start()
        t.join()
        assert other == [False]  # held here
    with tok.truncating() as again:
        assert again is mine and again("a b", "c")["input_ids"] == tok.hf("a b", "c")["input_ids"]
