"""LLaMA-2 model: Hugging Face parity (fp32, both directions), causality, named configs
(published LLaMA-2 sizes) built on the meta device without allocating."""
from __future__ import annotations

import pytest
import torch

from fp4lightning.models.llama import LLAMA_CONFIGS, Llama, LlamaConfig, init_weights_, llama_config

transformers = pytest.importorskip("transformers")
from fp4lightning.models import hf as hf_interop  # noqa: E402

# fp32 on CPU, same math in the same order: the two implementations agree to rounding
PARITY_ATOL = 1e-5
PARITY_RTOL = 1e-5


def _hf_model(n_kv: int, tie: bool = False):
    cfg = transformers.LlamaConfig(
        vocab_size=257, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=n_kv, max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, initializer_range=0.2,  # large weights: logits far from zero
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("n_kv,tie", [(6, False), (2, False), (3, True)], ids=["mha", "gqa", "gqa-tied"])
def test_hf_parity_both_directions(n_kv, tie):
    hf = _hf_model(n_kv, tie)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:  # RMSNorm gains: not all ones, so they are really compared
                p.uniform_(0.5, 1.5)
    idx = torch.randint(0, 257, (3, 41))
    # HF -> ours
    ours = hf_interop.from_hf_model(hf).eval()
    assert ours.config.kv_heads == n_kv and ours.config.tie_embeddings == tie
    with torch.no_grad():
        ref = hf(idx).logits
        got = ours(idx)
    assert ref.abs().mean() > 0.5
    torch.testing.assert_close(got, ref, atol=PARITY_ATOL, rtol=PARITY_RTOL)
    # ours (fresh random weights) -> HF
    mine = Llama(hf_interop.from_hf_config(hf.config))
    init_weights_(mine, std=0.2)
    back = hf_interop.to_hf_model(mine)
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, mine(idx), atol=PARITY_ATOL, rtol=PARITY_RTOL)
    # the state-dict layouts map one to one
    assert set(hf_interop.to_hf_state_dict(mine.state_dict(), mine.config)) <= set(back.state_dict())


def test_causal_and_shapes():
    cfg = llama_config("tiny", vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32)
    model = Llama(cfg).eval()
    idx = torch.randint(0, 300, (2, 20))
    idx2 = idx.clone()
    idx2[:, 12:] = torch.randint(0, 300, (2, 8))
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    assert a.shape == (2, 20, 300)
    torch.testing.assert_close(a[:, :12], b[:, :12])  # the past never sees the future
    assert not torch.allclose(a[:, 12:], b[:, 12:])
    with pytest.raises(ValueError, match="max_seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_init_statistics():
    cfg = llama_config("tiny", vocab_size=1024, dim=128, n_layers=2, n_heads=2, ffn_dim=352)
    model = Llama(cfg)
    w = model.layers[0].mlp.up_proj.weight
    assert abs(w.std().item() - cfg.init_std) < 0.1 * cfg.init_std
    assert torch.equal(model.norm.weight, torch.ones(128))
    assert model.num_params() == cfg.num_params()


# LLaMA-2 parameter counts as published by Meta / reported by transformers for the HF checkpoints
PUBLISHED_PARAMS = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320}


@pytest.mark.parametrize("name", sorted(LLAMA_CONFIGS))
def test_named_configs_on_meta_device(name):
    cfg = LLAMA_CONFIGS[name]
    with torch.device("meta"):
        model = Llama(cfg)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)  # nothing allocated
    n = model.num_params()
    assert n == cfg.num_params()
    if name in PUBLISHED_PARAMS:
        assert n == PUBLISHED_PARAMS[name]
    elif name == "llama2-1.3b":
        assert 1.2e9 < n < 1.45e9
    else:
        assert 1e6 < n < 1e7  # tiny: a few million
    # every GeMM is FP4-eligible (feature sizes multiples of 16)
    from fp4lightning.nn.linear import check_fp4_shape

    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            assert check_fp4_shape(mod.in_features, mod.out_features) is None, mod_name


def test_config_validation():
    with pytest.raises(ValueError, match="divisible"):
        LlamaConfig(dim=100, n_heads=3)
    with pytest.raises(ValueError, match="multiple of model.n_kv_heads"):
        LlamaConfig(dim=128, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="valid choices"):
        llama_config("llama2-70b")


# ----------------------------------------------------------------------------- init.from_hf / import-hf
def _init_cfg(*overrides: str):
    from fp4lightning.train.recipe import load_recipe

    shape = ["model.vocab_size=257", "model.dim=96", "model.n_layers=1", "model.n_heads=6", "model.ffn_dim=160",
             "model.tie_embeddings=true"]
    return load_recipe(None, [*shape, *overrides])


def test_init_accepts_mha_weights_whatever_way_n_kv_heads_is_spelled(tmp_path):
    """A recipe leaving model.n_kv_heads unset (= n_heads) takes its own export-hf folder, the import-hf
    checkpoint of it, and a recipe spelling n_kv_heads=n_heads takes a checkpoint that left it unset."""
    from fp4lightning.train.checkpoint import load_checkpoint
    from fp4lightning.train.init_weights import InitError, import_hf, load_init_weights

    ours = _init_cfg().llama_config()
    assert ours.n_kv_heads is None
    torch.manual_seed(0)
    hf_interop.save_hf(Llama(ours), tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "imported.ckpt")
    assert load_checkpoint(tmp_path / "imported.ckpt").model.config.kv_heads == 6
    for overrides in ([f"init.from_hf={tmp_path / 'hf'}"], [f"init.from_checkpoint={tmp_path / 'imported.ckpt'}"],
                      [f"init.from_hf={tmp_path / 'hf'}", "model.n_kv_heads=6"]):
        sd, have, _, _ = load_init_weights(_init_cfg(*overrides))
        assert have.kv_heads == 6 and sd["layers.0.self_attn.k_proj.weight"].shape == (96, 96), overrides
    # a real difference is still refused, naming the key and the value to set
    with pytest.raises(InitError, match=r"differs from the recipe's in n_kv_heads; set model.n_kv_heads=6"):
        load_init_weights(_init_cfg(f"init.from_hf={tmp_path / 'hf'}", "model.n_kv_heads=2"))


def test_import_hf_folder_without_weights_is_a_one_line_error(tmp_path, capsys):
    from fp4lightning.cli import main as cli_main
    from fp4lightning.train.init_weights import InitError, load_init_weights

    hf_interop.to_hf_config(_init_cfg().llama_config()).save_pretrained(tmp_path / "hf")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["config.json"]
    with pytest.raises(InitError, match=r"hf has config.json but no weights \(model.safetensors"):
        load_init_weights(_init_cfg(f"init.from_hf={tmp_path / 'hf'}"))
    capsys.readouterr()
    assert cli_main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "out.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no weights" in err and str(tmp_path / "hf") in err, err
    assert not (tmp_path / "out.ckpt").exists()
