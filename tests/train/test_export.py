"""Export of a trained model: a Hugging Face folder transformers loads with tokenloop's logits, a PEFT adapter that
gives transformers the LoRA model's logits, merge_lora, and a GGUF file in its base's types (byte for byte where
nothing changed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from tests.gguf_files import TOKENS, write_gguf
from tests.helpers import forward_in_chunks
from tests.models.test_tiny_hf_models import LLAMA3_ROPE_SCALING
from tokenloop.models.config import ModelConfig
from tokenloop.models.gguf_loader import unpermute_rope_rows
from tokenloop.models.gguf_metadata import open_gguf, read_metadata
from tokenloop.models.loader import LoadedModel, load_model
from tokenloop.models.weights import PACKED_MODULES, checkpoint_target
from tokenloop.sampling.params import SamplingParams
from tokenloop.train.export import (
    checkpoint_sources,
    hf_config,
    merge_lora,
    peft_key,
    save_hf_folder,
    save_peft_adapter,
)
from tokenloop.train.gguf_export import Q, export_gguf, permute_rope_rows, quantize_as

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def load(path: Path, tokenizer: bool = True) -> LoadedModel:
    return load_model(path, torch.float32, CPU, load_tokenizer=tokenizer)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def greedy(llm, prompts: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def with_random_lora(loaded: LoadedModel, r: int = 4, alpha: float = 8.0) -> dict[str, torch.Tensor]:
    """Inject LoRA into our module tree as the trainer does, with random A and B (a nonzero delta); its state."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        init_lora_weights=False,
    )
    torch.manual_seed(3)
    peft.inject_adapter_in_model(config, loaded.model)
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.05)
    return peft.get_peft_model_state_dict(loaded.model)


# ---- names ----


def test_checkpoint_sources_invert_checkpoint_target(tiny_gemma3_folder):
    config = load(tiny_gemma3_folder, tokenizer=False).config
    for layer_name in ("self_attn", "mlp"):
        for ckpt, (packed, _) in PACKED_MODULES.items():
            name = f"model.layers.1.{layer_name}.{ckpt}.weight"
            target, _, rows = checkpoint_target(config, name)
            if f".{packed}." in target and target.startswith(f"layers.1.{layer_name}.{packed}"):
                assert (name.removeprefix("model."), rows) in checkpoint_sources(config, target)
    assert checkpoint_sources(config, "layers.0.self_attn.o_proj.weight") == [
        ("layers.0.self_attn.o_proj.weight", slice(None))
    ]


def test_peft_key_shares_a_and_splits_b_rows(tiny_gemma3_folder):
    config = load(tiny_gemma3_folder, tokenizer=False).config  # 4 heads, 2 KV heads of 16: q 64 rows, k and v 32
    a = peft_key("layers.2.self_attn.qkv_proj.lora_A.weight", config)
    b = peft_key("layers.2.self_attn.qkv_proj.lora_B.weight", config)
    prefix = "base_model.model.model.layers.2.self_attn"
    assert a == [(f"{prefix}.{p}.lora_A.weight", slice(None)) for p in ("q_proj", "k_proj", "v_proj")]
    assert b == [
        (f"{prefix}.q_proj.lora_B.weight", slice(0, 64)),
        (f"{prefix}.k_proj.lora_B.weight", slice(64, 96)),
        (f"{prefix}.v_proj.lora_B.weight", slice(96, 128)),
    ]
    assert [k for k, _ in peft_key("layers.0.mlp.gate_up_proj.lora_B.weight", config)] == [
        "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight",
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight",
    ]
    with pytest.raises(ValueError, match="not a LoRA weight"):
        peft_key("layers.0.mlp.down_proj.weight", config)


# ---- Hugging Face folder ----


HF_CONFIGS = {
    "llama3-rope": lambda: transformers.LlamaConfig(
        rope_scaling=LLAMA3_ROPE_SCALING,
        tie_word_embeddings=True,
    ),
    "mistral-sliding-window": lambda: transformers.MistralConfig(sliding_window=8),
    "qwen2-bias": lambda: transformers.Qwen2Config(),
    "gemma3": lambda: transformers.Gemma3TextConfig(sliding_window=8),
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_config_json_round_trips_through_transformers(name):
    reference = HF_CONFIGS[name]()
    config = ModelConfig.from_hf_config(reference.to_dict() | {"architectures": [ARCHITECTURES[name]]})
    written = hf_config(config, None)
    assert ModelConfig.from_hf_config(written) == config
    read = type(reference)(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert read.rope_parameters == reference.rope_parameters
    assert getattr(read, "sliding_window", None) == getattr(reference, "sliding_window", None)


ARCHITECTURES = {
    "llama3-rope": "LlamaForCausalLM",
    "mistral-sliding-window": "MistralForCausalLM",
    "qwen2-bias": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


@pytest.mark.parametrize("fixture", ["tiny_model_folder", "tiny_gemma3_folder"])
def test_hf_folder_loads_in_transformers_and_tokenloop(fixture, request, tmp_path, make_llm):
    src = request.getfixturevalue(fixture)
    loaded = load(src)
    out = save_hf_folder(loaded.model, loaded.config, loaded.tokenizer, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in PROMPTS[:2]:
        ids = loaded.tokenizer.encode(text)
        assert hf_tokenizer(text).input_ids == ids
        torch.testing.assert_close(hf_logits(hf, ids), forward_in_chunks(loaded, ids, [len(ids)]), atol=1e-4, rtol=0)
    back = load(out)
    assert back.config == loaded.config
    assert back.tokenizer.chat_template == loaded.tokenizer.chat_template
    assert back.tokenizer.eos_token_ids == loaded.tokenizer.eos_token_ids
    assert back.tokenizer.add_bos_token == loaded.tokenizer.add_bos_token
    source = dict(loaded.model.named_parameters())
    for name, param in back.model.named_parameters():  # exact; Gemma's norms go through w = W - 1, then 1 + w
        torch.testing.assert_close(param, source[name], atol=1e-6 if "norm" in name else 0, rtol=0)
    assert greedy(make_llm(out), [TOKENS]) == greedy(make_llm(src), [TOKENS])


# ---- PEFT adapter and merge ----


@pytest.mark.parametrize("fixture", ["tiny_model_folder", "tiny_gemma3_folder"])
def test_peft_adapter_gives_transformers_the_lora_logits(fixture, request, tmp_path):
    peft = pytest.importorskip("peft")
    src = request.getfixturevalue(fixture)
    loaded = load(src, tokenizer=False)
    lora_state = with_random_lora(loaded, r=4, alpha=8.0)
    out = save_peft_adapter(lora_state, loaded.config, 4, 8.0, str(src), tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(base, out).eval()
    saved = peft.utils.load_peft_weights(str(out))
    loaded_state = peft.get_peft_model_state_dict(hf)
    assert set(loaded_state) == set(saved)  # no missing and no unexpected key
    assert all(torch.equal(loaded_state[k], saved[k]) for k in saved)
    ours = forward_in_chunks(loaded, TOKENS, [len(TOKENS)])
    delta = (ours - forward_in_chunks(load(src, tokenizer=False), TOKENS, [len(TOKENS)])).abs().max()
    assert delta > 1e-2  # the adapter changes the logits, so that the comparison below means something
    torch.testing.assert_close(hf_logits(hf, TOKENS), ours, atol=1e-4, rtol=0)


def test_merged_lora_is_a_plain_model_with_the_same_logits(tiny_gemma3_folder, tmp_path):
    from peft.tuners.lora import LoraLayer

    loaded = load(tiny_gemma3_folder)
    with_random_lora(loaded)
    with_adapter = forward_in_chunks(loaded, TOKENS, [len(TOKENS)])
    merge_lora(loaded.model)
    assert not any(isinstance(m, LoraLayer) for m in loaded.model.modules())
    assert not any("lora_" in name for name, _ in loaded.model.named_parameters())
    torch.testing.assert_close(forward_in_chunks(loaded, TOKENS, [len(TOKENS)]), with_adapter, atol=1e-5, rtol=0)
    out = save_hf_folder(loaded.model, loaded.config, loaded.tokenizer, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(hf, TOKENS), with_adapter, atol=1e-4, rtol=0)


def test_export_refuses_an_unmerged_model(tiny_model_folder, tmp_path):
    loaded = load(tiny_model_folder)
    with_random_lora(loaded)
    with pytest.raises(ValueError, match="merge_lora"):
        save_hf_folder(loaded.model, loaded.config, loaded.tokenizer, tmp_path / "hf")


# ---- GGUF ----


def test_rope_row_permutation_is_the_loaders_inverse():
    w = np.arange(8 * 12 * 3).reshape(8 * 12, 3)
    assert np.array_equal(unpermute_rope_rows(permute_rope_rows(w, 8), 8), w)


@pytest.fixture
def tiny_gguf(tiny_model, tmp_path) -> Path:
    arch, model = tiny_model
    return write_gguf(model, arch, tmp_path / f"{arch}.gguf", Q.Q4_1, embedding_qtype=Q.Q8_0)


def test_gguf_of_an_unchanged_model_is_the_base_file(tiny_gguf, tmp_path):
    loaded = load(tiny_gguf, tokenizer=False)
    result = export_gguf(loaded.model, loaded.config, None, tiny_gguf, tmp_path / "out.gguf")
    assert not result.requantized and not result.fallbacks
    assert (tmp_path / "out.gguf").read_bytes() == tiny_gguf.read_bytes()


def test_gguf_requantizes_changed_weights_in_the_base_types(tiny_gguf, tmp_path):
    loaded = load(tiny_gguf, tokenizer=False)
    with torch.no_grad():
        for layer in loaded.model.layers:
            layer.self_attn.qkv_proj.weight.add_(torch.randn_like(layer.self_attn.qkv_proj.weight) * 0.01)
    trained = {name: p.clone() for name, p in loaded.model.named_parameters()}
    result = export_gguf(loaded.model, loaded.config, None, tiny_gguf, tmp_path / "out.gguf")
    assert sorted(result.requantized) == sorted(f"blk.{i}.attn_{p}.weight" for i in range(2) for p in "qkv")
    base, out = open_gguf(tiny_gguf), open_gguf(tmp_path / "out.gguf")
    assert read_metadata(out) == read_metadata(base)
    for b, o in zip(base.tensors, out.tensors):
        assert (o.name, o.tensor_type) == (b.name, b.tensor_type)
        assert np.array_equal(o.data, b.data) == (o.name in result.kept)
    # Read back, a changed weight is its Q4_1 rounding: within a step (1/15 of a block's range) of the trained one,
    # in its own rows (a wrong q/k permutation would be off by whole weights).
    back = dict(load(tmp_path / "out.gguf", tokenizer=False).model.named_parameters())
    for name, param in trained.items():
        step = (param.max() - param.min()) / 15 if "qkv_proj" in name else 0
        assert (back[name] - param).abs().max() <= step, name


def test_k_quants_fall_back_to_the_types_llama_cpp_uses():
    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    for qtype, fallback in ((Q.Q4_K, Q.Q5_0), (Q.Q6_K, Q.Q8_0), (Q.Q4_1, Q.Q4_1)):
        data, written = quantize_as(w, qtype)
        assert written == fallback
        assert np.array_equal(data, quantize(w, fallback))


# ---- real models ----


# Fixtures by name, through getfixturevalue: conftest's automatic real_model marker does not see them.
@pytest.fixture(params=["default_model_path", "gemma3_path"])
def real_gguf(request) -> Path:
    return request.getfixturevalue(request.param)


@pytest.mark.real_model
def test_real_model_hf_folder_matches_transformers_and_the_gguf(real_gguf, tmp_path, make_llm):
    loaded = load(real_gguf)
    out = save_hf_folder(loaded.model, loaded.config, loaded.tokenizer, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in PROMPTS:
        ids = loaded.tokenizer.encode(text)
        assert hf_tokenizer(text).input_ids == ids
        torch.testing.assert_close(hf_logits(hf, ids), forward_in_chunks(loaded, ids, [len(ids)]), atol=1e-4, rtol=0)
    del hf, loaded
    assert greedy(make_llm(out), PROMPTS) == greedy(make_llm(real_gguf), PROMPTS)


@pytest.mark.real_model
def test_real_model_gguf_round_trips_byte_for_byte(real_gguf, tmp_path):
    """Unchanged, the export is the base file. Measured too: gguf-py's quantization of the dequantized tensors
    gives back the file's bytes for every Q4_1, Q5_0 and Q8_0 tensor (the route a changed weight takes)."""
    loaded = load(real_gguf)
    out = tmp_path / "out.gguf"
    export_gguf(loaded.model, loaded.config, loaded.tokenizer, real_gguf, out)
    del loaded
    assert out.read_bytes() == real_gguf.read_bytes()
    for t in open_gguf(real_gguf).tensors:
        if t.tensor_type in (Q.Q4_1, Q.Q5_0, Q.Q8_0):
            assert np.array_equal(quantize(dequantize(t.data, t.tensor_type), t.tensor_type), t.data), t.name


def test_smollm2_gguf_export_generates_the_base_tokens(default_model_path, tmp_path, make_llm):
    loaded = load(default_model_path)
    out = tmp_path / "out.gguf"
    export_gguf(loaded.model, loaded.config, loaded.tokenizer, default_model_path, out)
    del loaded
    fast = {"dtype": "auto", "threads": 2}  # the fast path: the file's integers kept
    assert greedy(make_llm(out, **fast), PROMPTS) == greedy(make_llm(default_model_path, **fast), PROMPTS)


def test_gemma3_changed_k_quants_fall_back(gemma3_path, tmp_path, make_llm):
    """Gemma 3 270M Q4_K_M: a changed Q4_K tensor is written Q5_0, a Q6_K one Q8_0 (gguf-py quantizes no K-quant);
    its Q5_0 and Q8_0 tensors come back in their own bytes. The file loads on the fast path and generates."""
    loaded = load(gemma3_path)
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            if name.startswith("layers.") and param.dim() == 2:
                param.mul_(1 + 2**-20)  # changed by an ulp or so: every weight but the embedding and norms
    out = tmp_path / "out.gguf"
    result = export_gguf(loaded.model, loaded.config, loaded.tokenizer, gemma3_path, out)
    del loaded
    assert set(result.fallbacks.values()) == {("Q4_K", "Q5_0"), ("Q6_K", "Q8_0")}
    assert len(result.fallbacks) == 36 and len(result.requantized) == 90
    base = {t.name: t for t in open_gguf(gemma3_path).tensors}
    assert all(
        np.array_equal(t.data, base[t.name].data) for t in open_gguf(out).tensors if t.name in result.requantized
    )
    assert all(len(tokens) == GREEDY.max_tokens for tokens in greedy(make_llm(out, dtype="auto", threads=2), PROMPTS))
