"""Real published mergekit-moe configs (tests/data/mergekit_configs/published, sources in its README) build
unchanged where mergekit-moe 0.1.5 builds them, and are refused with the key and the fix where it refuses them.

Hub ids are served by tiny stand-ins from a fake Hugging Face cache (`fake_hub`); configs that name local
folders get them laid out under the test's folder (absolute ``/tmp/...`` prefixes are re-rooted there).
The second half covers the classes of pasted-config trouble around them: Windows line endings and BOM,
tabs and look-alike spaces, other encodings, prompts that are strings, numbers, booleans or null,
LoRA / double-revision / URL references, and very long or non-ASCII prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import model_logits
from fake_hub import build_hub_cache, local_refs, model_refs
from moe_upcycle.build import upcycle
from moe_upcycle.checkpoint.model_refs import resolve_model
from moe_upcycle.checkpoint.tiny import make_dense_model, make_finetune
from moe_upcycle.errors import UpcycleError
from moe_upcycle.recipe.schema import load_config

PUBLISHED = Path(__file__).resolve().parent / "data" / "mergekit_configs" / "published"

# file -> (model_type, architecture class, experts, experts per token, dtype) of the built output
BUILDS = {
    "mergekit_docs_clown_car": ("mixtral", "MixtralForCausalLM", 4, 2, "bfloat16"),
    "mergekit_docs_smol_llama_upcycle": ("mixtral", "MixtralForCausalLM", 8, 2, "bfloat16"),
    "beyonder_4x7b_v3": ("mixtral", "MixtralForCausalLM", 4, 2, "float32"),
    "beyonder_4x7b_v3_windows": ("mixtral", "MixtralForCausalLM", 4, 2, "float32"),
    "l31_moe_4x8b_v02": ("mixtral", "MixtralForCausalLM", 4, 2, "bfloat16"),
    "l31_moe_2x8b_v02": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "einstein_cheap_embed_fp16": ("mixtral", "MixtralForCausalLM", 2, 2, "float16"),
    "tiny_mistral_4x_comments": ("mixtral", "MixtralForCausalLM", 4, 2, "bfloat16"),
    "bagel_34b_local_names": ("mixtral", "MixtralForCausalLM", 4, 2, "bfloat16"),
    "vigyan_qwen2_shared_top1": ("qwen2_moe", "Qwen2MoeForCausalLM", 4, 1, "bfloat16"),
    "aoyinke_qwen2_random_shared_empty_prompts": ("qwen2_moe", "Qwen2MoeForCausalLM", 2, 2, "bfloat16"),
    "femiari_qwen2_space_before_colon": ("qwen2_moe", "Qwen2MoeForCausalLM", 2, 2, "float32"),
    "minicpm_x4_random_same_model": ("mixtral", "MixtralForCausalLM", 4, 2, "float32"),
    "my_mixtral_2x7b_cheap_embed_empty_default": ("mixtral", "MixtralForCausalLM", 2, 2, "float32"),
    "aegolius_v1_5x_negatives_case_variants": ("mixtral", "MixtralForCausalLM", 5, 2, "float32"),
    "l3_2x8b_leading_blank_line_negatives": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "swestarling_swedish_cheap_embed": ("mixtral", "MixtralForCausalLM", 4, 2, "float32"),
    "wizardlm2_4x7b_top4_local_folder": ("mixtral", "MixtralForCausalLM", 4, 4, "float16"),
    "tiny_moe_rand_template_comments": ("mixtral", "MixtralForCausalLM", 2, 2, "bfloat16"),
    "random_merge_comma_prompts_cheap_embed": ("mixtral", "MixtralForCausalLM", 2, 2, "float16"),
    "yi_coder_8x_random_trailing_comment": ("mixtral", "MixtralForCausalLM", 8, 2, "bfloat16"),
    "biomistral_6x_random_template_prompts": ("mixtral", "MixtralForCausalLM", 6, 2, "bfloat16"),
    "hai_ser_same_model_twice_cheap_embed": ("mixtral", "MixtralForCausalLM", 2, 2, "float16"),
    "solar_korean_tokenizer_source": ("mixtral", "MixtralForCausalLM", 2, 2, "float16"),
    "lawgpt_qwen3_random_8x": ("qwen3_moe", "Qwen3MoeForCausalLM", 8, 2, "bfloat16"),
    "llmtest2_qwen_shared_first_local": ("qwen2_moe", "Qwen2MoeForCausalLM", 3, 2, "float16"),
}
# file -> words the refusal must contain (what is wrong, where, and the fix)
REFUSED = {
    "sonya_8x_same_empty_prompts": ["experts: every expert has the same prompts (positive_prompts: '')",
                                    "(mergekit-moe refuses this too)",
                                    "write num_experts: 8 with gate_mode: random instead of the experts list"],
    "lumosia_4x10b_empty_prompts": ["experts: every expert has the same prompts", "gate_mode hidden",
                                    "give each expert prompts for the text it should handle"],
    "phixtral_4x2_8": ["every expert has the same prompts", "gate_mode cheap_embed"],
    "phi2_sample_tokenizer_key": ["tokenizer: unknown key", "--allow-unknown-keys"],
    "medtral_2x7b_string_prompts": [
        "experts[0].positive_prompts: a single string 'As a doctor of medicine,', not a list",
        'write it as a one-item list: positive_prompts: ["As a doctor of medicine,"]',
        "experts[1].positive_prompts: a single string"],
    "gateway_mode_typo_chinese": ["gateway_mode: unknown key — did you mean gate_mode?"],
    "qwen25_coder_gemma2_mixed": ["experts[1] (google/gemma-2-2b-it): model_type", "differs from base_model's 'qwen2'"],
    "llama31_mixed_sizes": ["WizardLMTeam/WizardCoder-Python-7B-V1.0", "intermediate_size"],
    "gguf_merge_method_moe": ["merge_method: unknown key", "parameters: unknown key"],
    "mergekit_docs_shared_template": ["experts: '...' is not a list of experts",
                                      "one '- source_model: ...' line per expert"],
    "gitcode_qwen_shared_placeholders": ["experts: every expert has the same prompts (positive_prompts: '...')"],
    "theqwenmoe_qwen25_mixed_sizes_shared": [
        "experts[1] (Qwen/Qwen2.5-Math-1.5B-Instruct): intermediate_size is 96 but base_model "
        "huihui-ai/Qwen2.5-7B-Instruct-abliterated-v2 has 128",
        "experts[3] (RefalMachine/ruadapt_qwen2.5_3B_ext_u48_instruct_v4): intermediate_size is 96"],
    "metamodel_moe_hidden_no_prompts": [f"experts[{i}].positive_prompts: gate_mode hidden needs at least one prompt"
                                        for i in range(4)],
    "qwen25_05b_mixtral_inline_comments_null_prompts": [
        "experts[4].positive_prompts: gate_mode hidden needs at least one prompt"],
    "dark_multiverse_windows_drive_paths": [
        "base_model: model 'F:/7B/Multi-Verse-RP' not found",
        "it is a Windows path (drive F:), and this machine names folders POSIX-style",
        "(under WSL drive F: is /mnt/f: /mnt/f/7B/Multi-Verse-RP)",
        "experts[2].source_model: model 'F:/7B/DarkSapling-V2' not found"],
    "theta_cat_backslash_paths": [
        "base_model: model 'D:\\models\\llama-3-cat-8B-instruct' not found",
        "it is a Windows path (drive D:)", "/mnt/d/models/Hermes-2-Theta-Llama-3-8B"],
    "aegolius_nano_header_pasted": [
        "aegolius_nano_header_pasted.yaml:2:11: YAML syntax error: mapping values are not allowed here",
        "line 1 ('GNU nano 6.2 mergekit_moe_configfs.yml') is not a 'key: value' line",
        "delete line 1, or make it a comment with #"],
    "molmoe_6x_top6_special_token_prompt": [
        "experts[0].positive_prompts: prompt '<s>' has no tokens besides special tokens",
        "or build with --mergekit, which computes the routers as mergekit-moe does"],
}
# local folders named by the configs, and the family that stands in for them
LOCAL_FAMILY = {"bagel_34b_local_names": "llama", "vigyan_qwen2_shared_top1": "qwen2",
                "wizardlm2_4x7b_top4_local_folder": "llama", "llmtest2_qwen_shared_first_local": "qwen2",
                "molmoe_6x_top6_special_token_prompt": "llama"}
# a stand-in of another FFN size for the one expert of llama31_mixed_sizes that is a Llama-2 7B
OTHER_SIZE = "WizardLMTeam/WizardCoder-Python-7B-V1.0"
# theqwenmoe's 1.5B and 3B experts next to its 7B base: a Qwen2 stand-in of another FFN size
OTHER_QWEN_SIZE = ("Qwen/Qwen2.5-Math-1.5B-Instruct", "Qwen/Qwen2.5-Coder-3B-Instruct",
                   "RefalMachine/ruadapt_qwen2.5_3B_ext_u48_instruct_v4")
# local folders whose names look like hub ids (org/name): laid out as folders, never put in the cache
HUB_LOOKALIKE_FOLDERS = {"models/WizardLM-2-7B"}


def read_config(path: Path) -> dict:
    return yaml.safe_load(path.read_bytes().decode("utf-8-sig"))


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory, tiny_llama, tiny_qwen2, tiny_qwen3) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("published_stand_ins")
    out = {family: [base] + [make_finetune(base, root / f"{family}_ft{s}", seed=s) for s in (1, 2)]
           for family, base in (("llama", tiny_llama), ("qwen2", tiny_qwen2), ("qwen3", tiny_qwen3))}
    out["phi"] = [make_dense_model(root / "phi", family="phi", seed=7)]
    out["llama_other_size"] = [make_dense_model(root / "llama_other_size", family="llama", seed=8,
                                                intermediate_size=96)]
    out["qwen2_other_size"] = [make_dense_model(root / "qwen2_other_size", family="qwen2", seed=9,
                                                intermediate_size=96, random_norms_and_biases=True)]
    return out


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, stand_ins) -> Path:
    refs = set()
    for path in PUBLISHED.glob("*.yaml"):
        try:
            refs |= model_refs(read_config(path))
        except yaml.YAMLError:
            pass
    overrides = {OTHER_SIZE: stand_ins["llama_other_size"][0],
                 **{ref: stand_ins["qwen2_other_size"][0] for ref in OTHER_QWEN_SIZE}}
    return build_hub_cache(tmp_path_factory.mktemp("hf_cache"), stand_ins, refs - HUB_LOOKALIKE_FOLDERS,
                           overrides=overrides)


@pytest.fixture
def published(hub_cache, stand_ins, monkeypatch, tmp_path):
    """Path of a published config ready to build here: hub ids cached, local folders laid out under tmp_path."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.chdir(tmp_path)

    def prepare(name: str) -> Path:
        path = PUBLISHED / f"{name}.yaml"
        if name not in LOCAL_FAMILY:
            return path
        text = path.read_text(encoding="utf-8").replace("/tmp/", f"{tmp_path}/")
        models = stand_ins[LOCAL_FAMILY[name]]
        data = yaml.safe_load(text)
        for i, ref in enumerate(sorted(local_refs(data) | (model_refs(data) & HUB_LOOKALIKE_FOLDERS))):
            folder = Path(ref) if ref.startswith("/") else tmp_path / ref
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.symlink_to(models[i % len(models)], target_is_directory=True)
        copy = tmp_path / path.name
        copy.write_text(text, encoding="utf-8")
        return copy

    return prepare


def test_every_published_config_has_an_expectation():
    names = {p.stem for p in PUBLISHED.glob("*.yaml")}
    assert len(names) >= 44
    assert names == set(BUILDS) | set(REFUSED)
    listed = (PUBLISHED / "README.md").read_text(encoding="utf-8")
    assert all(f"`{n}.yaml`" in listed for n in names), "every config names its source in the README"


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_published_config_builds_unchanged(name, published, tmp_path):
    model_type, arch_class, n_experts, per_token, dtype = BUILDS[name]
    result = upcycle(published(name), tmp_path / "out", checksums=False)
    config = json.loads((result.output / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (model_type, [arch_class])
    experts_key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    assert (config[experts_key], config["num_experts_per_tok"], config["dtype"]) == (n_experts, per_token, dtype)
    assert torch.isfinite(model_logits(result.output)).all()  # transformers loads it, no missing/unexpected keys


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_published_config_refused_with_key_and_fix(name, published, tmp_path):
    with pytest.raises(UpcycleError) as info:
        upcycle(published(name), tmp_path / "out", checksums=False)
    text = " ".join(str(info.value).split())
    for words in REFUSED[name]:
        assert words in text, text
    assert not (tmp_path / "out").exists()


def test_windows_copy_reads_exactly_like_the_original():
    """CRLF line endings and a UTF-8 BOM (Notepad) change nothing, as in mergekit-moe."""
    windows = PUBLISHED / "beyonder_4x7b_v3_windows.yaml"
    assert windows.read_bytes().startswith(b"\xef\xbb\xbf") and b"\r\n" in windows.read_bytes()
    assert load_config(windows) == load_config(PUBLISHED / "beyonder_4x7b_v3.yaml")


def test_bagel_unbalanced_quote_is_read_as_yaml_reads_it():
    """`science"` inside a flow list is a plain scalar with a quote in it: mergekit routes on it as written."""
    config = load_config(PUBLISHED / "bagel_34b_local_names.yaml")
    assert config.experts[0].positive_prompts[2] == 'science"'


# ---------------------------------------------------------------------------------------------
# Classes of pasted-config trouble: each refused with the line or key and the fix

BEYONDER = (PUBLISHED / "beyonder_4x7b_v3.yaml").read_text(encoding="utf-8")


@pytest.mark.parametrize("case, data, words", [
    ("tab-indent", BEYONDER.replace("    positive_prompts", "\tpositive_prompts", 1).encode(),
     [":4:1: YAML syntax error", "line 4 has a tab; YAML indents with spaces", "replace the tab with spaces"]),
    ("tab-after-colon", BEYONDER.replace("base_model: ", "base_model:\t", 1).encode(),
     [":1:12: YAML syntax error", "line 1 has a tab"]),
    ("nbsp-indent", BEYONDER.replace("  - source_model", "\u00a0 - source_model", 1).encode(),
     ["YAML syntax error", "line 3 contains a non-breaking space (U+00A0)", "replace it with a normal space"]),
    ("ideographic-space", BEYONDER.replace("  - source_model", "\u3000 - source_model", 1).encode(),
     ["line 3 contains an ideographic space (U+3000)"]),
    ("utf16-notepad", BEYONDER.encode("utf-16"),
     ["not a UTF-8 text file (it is UTF-16, what Windows calls 'Unicode')", "re-save it as UTF-8"]),
    ("cp1252", BEYONDER.replace('"chat"', '"caf\u00e9"').encode("cp1252"),
     ["not a UTF-8 text file (byte 0xe9 at position", "re-save it as UTF-8"]),
    ("markdown-fence", ("```yaml\n" + BEYONDER + "```\n").encode(),
     ["YAML syntax error", "line 1 is a Markdown code fence; copy only the YAML between the fences"]),
    ("model-card-front-matter", ("---\nlicense: apache-2.0\ntags: [moe]\n---\n" + BEYONDER).encode(),
     ["YAML syntax error", "more than one YAML document", "keep only the config"]),
    ("star-prompt", BEYONDER.replace('- "chat"', "- *chat with me*").encode(),
     [":5:7: YAML syntax error: found undefined alias", "starts with * is read as an alias", "put it in quotes"]),
    ("at-prompt", BEYONDER.replace('- "chat"', "- @assistant hi").encode(),
     ["YAML reserves @ and ` at the start of a value; put the value in quotes"]),
    # a rendered model card turns list dashes into bullets; YAML read them as keys or as one long prompt
    ("bullet-expert", BEYONDER.replace("  - source_model", "  \u2022 source_model", 1).encode(),
     [":3: line 3 starts with '\u2022' (U+2022), a list bullet copied from a rendered page",
      "YAML list items start with '-': write - source_model: mlabonne/AlphaMonarch-7B"]),
    ("dash-bullets", BEYONDER.replace("  - source_model", "  \u2013 source_model").encode(),
     [":3: line 3 starts with '\u2013' (U+2013)"]),
    ("bullet-prompts", BEYONDER.replace('    - "chat"', '    \u2022 "chat"', 1).encode(),
     ["starts with '\u2022' (U+2022)", 'write - "chat"']),
    # unquoted bulleted prompts below the key: YAML joined them into one string '\u2022 chat \u2022 code', and the
    # bare-string refusal quoted that back as the fix, bullets and all, without a line
    ("bullet-plain-prompts", BEYONDER.replace('    - "chat"\n    - "assistant"', '      \u2022 chat\n      \u2022 assistant',
                                              1).encode(),
     [":5: line 5 starts with '\u2022' (U+2022), a list bullet copied from a rendered page",
      "YAML list items start with '-': write - chat"]),
    ("dash-plain-prompts", BEYONDER.replace('    - "chat"\n    - "assistant"', '      \u2013 chat\n      \u2013 assistant',
                                            1).encode(),
     [":5: line 5 starts with '\u2013' (U+2013)"]),
    # curly quotes are text to YAML: a comma inside them split one prompt in two (whole ones are kept as written)
    ("curly-quotes-split", BEYONDER.replace('    positive_prompts:\n    - "chat"',
                                            '    positive_prompts: [\u201cchat, then code\u201d, \u201cok\u201d]\n'
                                            '    negative_prompts:\n    - "chat"', 1).encode(),
     ["experts[0].positive_prompts: prompts 0 to 1 are one prompt in curly quotes, \u201cchat, then code\u201d, that "
      "YAML split at its comma: curly quotes are not YAML quotes; write the prompt in straight quotes"]),
])
def test_pasted_file_trouble_names_the_line_and_fix(case, data, words, tmp_path):
    path = tmp_path / "pasted.yaml"
    path.write_bytes(data)
    with pytest.raises(UpcycleError) as info:
        load_config(path)
    text = str(info.value)
    for w in words:
        assert w in text, text


@pytest.mark.parametrize("prompts, words", [
    ("positive_prompts: \"As a doctor of medicine,\"",
     ["experts[0].positive_prompts: a single string 'As a doctor of medicine,', not a list",
      'positive_prompts: ["As a doctor of medicine,"]']),
    ("negative_prompts: 'no code'", ["experts[0].negative_prompts: a single string 'no code', not a list"]),
    ("positive_prompts: 42", ["experts[0].positive_prompts: 42 is not a list"]),
    ("positive_prompts: [yes, 'ok']",
     ["experts[0].positive_prompts: prompt 0 is true, which YAML read as a boolean", "put the prompt in quotes"]),
    ("positive_prompts: [2024, 3.5]",
     ["prompt 0 is 2024, which YAML read as a number", "prompt 1 is 3.5, which YAML read as a number"]),
    ("positive_prompts:\n      - Q: What is the capital of France?\n      - [Genres: Science Fiction]",
     ["prompt 0 is the mapping {Q: What is the capital of France?}: YAML reads 'word: text' as a key",
      "prompt 1 is a list: YAML reads [...] as a list; put the prompt in quotes"]),
    ("positive_prompts:\n      -\n      - chat",
     ["prompt 0 is empty (a bare '-' line, which YAML reads as null)", 'write "" for the empty prompt']),
])
def test_prompt_values_that_are_not_text(prompts, words, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"base_model: m\ngate_mode: hidden\nexperts:\n  - source_model: a\n    {prompts}\n"
                    f"  - source_model: b\n    positive_prompts: [code]\n", encoding="utf-8")
    with pytest.raises(UpcycleError) as info:
        load_config(path)
    text = " ".join(str(info.value).split())
    for w in words:
        assert w in text, text


@pytest.mark.parametrize("experts, refused", [
    # the same prompts everywhere: refused for every mode that routes on prompts, as by mergekit-moe
    ([{"positive_prompts": ["chat"]}, {"positive_prompts": ["chat"]}], True),
    ([{"positive_prompts": ["a"], "negative_prompts": ["b"]}, {"positive_prompts": ["a"], "negative_prompts": ["b"]}],
     True),
    # one difference is enough, in positives or negatives
    ([{"positive_prompts": ["chat"]}, {"positive_prompts": ["chat"], "negative_prompts": ["code"]}], False),
    ([{"positive_prompts": [""]}, {"positive_prompts": ["math"]}], False),
])
@pytest.mark.parametrize("mode", ["hidden", "hidden_avg", "hidden_last", "cheap_embed", "random", "uniform_random"])
def test_identical_prompts_for_every_expert(experts, refused, mode):
    data = {"base_model": "org/base", "gate_mode": mode,
            "experts": [{"source_model": f"org/model-{i}", **e} for i, e in enumerate(experts)]}
    config = load_config(data)  # loads: `prompts grow` is how such a config gets its prompts
    problem = config.same_prompts_problem()
    if refused and mode not in ("random", "uniform_random"):  # random rows do not read prompts
        assert problem.startswith("experts: every expert has the same prompts") and "prompts grow" in problem
        assert "num_experts" not in problem  # different models: no copies to suggest
        with pytest.raises(UpcycleError, match="every expert has the same prompts"):
            upcycle(data, dry_run=True)  # plan and build refuse it before opening any model
    else:
        assert problem is None


@pytest.mark.parametrize("ref, words", [
    ("mistralai/Mistral-7B-v0.1+someone/mistral-lora",
     ["'mistralai/Mistral-7B-v0.1'+'someone/mistral-lora' is mergekit's model+LoRA form",
      "the model and the adapter must each be a folder or a hub id in the local cache",
      "download mistralai/Mistral-7B-v0.1"]),
    ("mistralai/Mistral-7B-v0.1@main+someone/lora@v2", ["mergekit's model+LoRA form", "--revision main"]),
    ("mistralai/Mistral-7B-v0.1+a/b+c/d", ["names more than one '+'", "merge_and_unload()"]),
    ("mistralai/Mistral-7B-v0.1@main@v2", ["a model reference has at most one '@' (org/name@revision"]),
    ("https://huggingface.co/mistralai/Mistral-7B-v0.1/tree/main",
     ["write the hub id, not its web address: mistralai/Mistral-7B-v0.1"]),
])
def test_mergekit_reference_forms_we_do_not_read(ref, words, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(UpcycleError) as info:
        resolve_model(ref, "experts[0].source_model")
    text = str(info.value)
    assert text.startswith("experts[0].source_model: model ")
    for w in words:
        assert w in text, text


def test_long_and_non_ascii_prompts_build(published, tmp_path):
    """A prompt far longer than the model's positions, CJK, Cyrillic, Arabic, emoji ZWJ sequences and typography."""
    from safetensors.torch import load_file

    prompts = ["Once upon a time there was a little dragon who " * 120, "你是一个很擅长数学的助手。",
               "Привет, как дела? 🐉👨‍👩‍👧", "مرحبا كيف حالك", "Ünïcödé — “quotes” … \u200b"]
    base, other = "NousResearch/Hermes-2-Pro-Mistral-7B", "BioMistral/BioMistral-7B-DARE"  # cached for the clown car
    for mode in ("hidden", "cheap_embed"):
        config = {"base_model": base, "gate_mode": mode, "dtype": "float32",
                  "experts": [{"source_model": base, "positive_prompts": prompts[:1]},
                              {"source_model": other, "positive_prompts": prompts[1:]}]}
        path = tmp_path / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
        out = upcycle(path, tmp_path / mode, checksums=False).output
        state = {}
        for shard in out.glob("*.safetensors"):
            state.update(load_file(str(shard)))
        for layer in range(2):
            rows = state[f"model.layers.{layer}.block_sparse_moe.gate.weight"]  # (E, H)
            assert rows.shape[0] == 2 and torch.isfinite(rows).all()
            assert torch.nn.functional.cosine_similarity(rows[0], rows[1], dim=0) < 0.99  # two distinct routes


@pytest.mark.parametrize("value, ours", [
    ({"model": "mistralai/Mistral-7B-v0.1"}, "mistralai/Mistral-7B-v0.1"),
    ({"model": {"path": "mistralai/Mistral-7B-v0.1", "revision": "main"}}, "mistralai/Mistral-7B-v0.1@main"),
    ({"model": {"path": "mistralai/Mistral-7B-v0.1"}, "lora": {"path": "me/adapter"}},
     "mistralai/Mistral-7B-v0.1+me/adapter"),
])
def test_mergekit_mapping_form_of_a_model_reference(value, ours):
    """mergekit-moe reads ``{model: {path, revision}, lora}`` wherever a reference goes; so do we."""
    config = load_config({"base_model": value, "gate_mode": "random",
                          "experts": [{"source_model": value}, {"source_model": "org/other"}]})
    assert config.base_model == config.experts[0].source_model == ours


@pytest.mark.parametrize("value, words", [
    ({"model": "org/x", "override_architecture": "MistralForCausalLM"},
     "override_architecture: 'MistralForCausalLM' cannot be applied"),
    ({"path": "org/x"}, "a mapping with path is not a model reference; write org/name, org/name@revision or a folder"),
    ({"model": 7}, "7 is not a model path"),
])
def test_mapping_references_we_cannot_read(value, words):
    with pytest.raises(UpcycleError) as info:
        load_config({"base_model": "org/base", "gate_mode": "random",
                     "experts": [{"source_model": value}, {"source_model": "org/other"}]})
    assert f"experts[0].source_model: {words}" in str(info.value)


def test_unprompted_shared_expert_on_llama_says_mergekit_would_write_deepseek(tiny_llama):
    """Without architecture:, mergekit-moe writes remote-code DeepSeek MoE here; the plan says what we write."""
    from moe_upcycle.build import upcycle as build

    base = str(tiny_llama)
    experts = [{"source_model": base}, {"source_model": base}]
    plain = build({"base_model": base, "gate_mode": "random", "experts": experts,
                   "shared_experts": [{"source_model": base, "residual_scale": 0.1}]}, dry_run=True).plan
    assert plain.architecture == "qwen2_moe"
    assert any("mergekit-moe 0.1.5 writes DeepSeek MoE for llama experts" in n and "architecture: qwen2_moe" in n
               for n in plain.notes), plain.notes
    # DeepSeek adds the shared expert at full weight; the constant gate halves it: the note gives the doubled scale
    assert any("for mergekit's FFN output set shared_experts[0].residual_scale: 0.2" in n for n in plain.notes)
    advised = build({"base_model": base, "gate_mode": "random", "experts": experts, "architecture": "qwen2_moe",
                     "shared_experts": [{"source_model": base, "residual_scale": 0.2}]}, dry_run=True).plan
    assert any("1 x routed + 1/2 x 0.2 x shared" in n for n in advised.notes), advised.notes
    # a doubled scale past the recipe's limit is not advised: the limit is, with what it leaves
    big = build({"base_model": base, "gate_mode": "random", "experts": experts,
                 "shared_experts": [{"source_model": base, "residual_scale": 60}]}, dry_run=True).plan
    assert any("shared_experts[0].residual_scale: 100 — the furthest it goes; DeepSeek's weight would need 120, so "
               "this one stays at 50x, not 60x" in n for n in big.notes), big.notes
    negative = build({"base_model": base, "gate_mode": "random", "experts": experts,
                      "shared_experts": [{"source_model": base, "residual_scale": -60}]}, dry_run=True).plan
    assert any("shared_experts[0].residual_scale: -100 — the furthest it goes; DeepSeek's weight would need -120"
               in n for n in negative.notes), negative.notes
    explicit = build({"base_model": base, "gate_mode": "random", "experts": experts, "architecture": "qwen2_moe",
                      "shared_experts": [{"source_model": base}]}, dry_run=True).plan
    assert not any("DeepSeek" in n for n in explicit.notes)


@pytest.mark.parametrize("key, value, words", [
    ("tokenizer_source", "union", "the MoE gets base_model's tokenizer, as with mergekit-moe"),
    ("tokenizer", {"source": "base", "tokens": {"<|im_start|>": {"source": "org/chat"}}},
     "the MoE gets base_model's tokenizer, as with mergekit-moe"),
    ("chat_template", "chatml", "the MoE gets base_model's chat template, as with mergekit-moe"),
    ("merge_method", "moe", "a MoE has no merge method (that key is mergekit-yaml's)"),
    ("slices", [{"sources": [{"model": "org/x", "layer_range": [0, 32]}]}], "mergekit-moe reads experts:, not slices: (that key is mergekit-yaml's)"),
])
def test_mergekit_yaml_keys_say_what_happens_instead(key, value, words):
    """Keys of mergekit's merge configs, which mergekit-moe ignores: refused by default with what the MoE gets."""
    data = {"base_model": "org/base", "gate_mode": "random", key: value,
            "experts": [{"source_model": "org/a"}, {"source_model": "org/b"}]}
    with pytest.raises(UpcycleError) as info:
        load_config(data)
    assert f"{key}: unknown key — {words}; remove it, or pass --allow-unknown-keys" in str(info.value)
    with pytest.warns(UserWarning, match=f"{key}: unknown key ignored"):
        assert load_config(data, allow_unknown_keys=True).base_model == "org/base"


def test_hub_ids_are_found_in_the_cache_whatever_their_case(published):
    """The hub treats `Mistralai/...` and `mistralai/...` as one repo (a tutorial above writes the former)."""
    cached = resolve_model("NousResearch/Hermes-2-Pro-Mistral-7B", "base_model")
    assert resolve_model("NOUSRESEARCH/hermes-2-pro-mistral-7b", "base_model") == cached
    assert resolve_model("nousresearch/Hermes-2-Pro-Mistral-7B@main", "base_model") == cached
    with pytest.raises(UpcycleError, match="model 'nousresearch/Hermes-2-Pro-Mistral-7C' not found"):
        resolve_model("nousresearch/Hermes-2-Pro-Mistral-7C", "base_model")


@pytest.mark.parametrize("spelling", ["float64", "torch.float64", "double"])
def test_float64_is_refused_with_the_dtype_to_use(spelling):
    """mergekit-moe writes float64 (twice float32's size); we refuse it and name float32."""
    with pytest.raises(UpcycleError) as info:
        load_config({"base_model": "m", "num_experts": 2, "gate_mode": "random", "dtype": spelling})
    assert f"dtype: {spelling!r} is not an output dtype here" in str(info.value) and "use float32" in str(info.value)


@pytest.mark.parametrize("experts, words", [
    (["org/a", "org/b"], ["experts[0]: a bare string; write it as - source_model: org/a", "experts[1]: a bare string"]),
    ([{"source_model": "org/a"}, None], ["experts[1]: empty (a bare '-' line); remove the line or give it source_model:"]),
    ([{"source_model": "org/a"}, 3], ["experts[1]: 3, not an expert; write - source_model: org/name (a mapping)"]),
])
def test_experts_that_are_not_mappings(experts, words):
    with pytest.raises(UpcycleError) as info:
        load_config({"base_model": "org/base", "gate_mode": "random", "experts": experts})
    for w in words:
        assert w in str(info.value), str(info.value)


@pytest.mark.parametrize("config", ["null_prompts_hidden.yaml", "published/medtral_2x7b_string_prompts.yaml",
                                    "published/sonya_8x_same_empty_prompts.yaml"])
def test_plan_refuses_what_build_refuses_for_want_of_prompts(config):
    """`plan` said nothing about hidden gates without prompts, which `build` then refused."""
    from typer.testing import CliRunner

    from moe_upcycle.cli import app

    result = CliRunner().invoke(app, ["plan", str(PUBLISHED.parent / config)])
    assert result.exit_code == 1, result.output
    assert "error" in result.output and "prompt" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("where, key, hint", [
    ("expert", "prompts", "positive_prompts"), ("expert", "positive", "positive_prompts"),
    ("expert", "negative", "negative_prompts"), ("expert", "source", "source_model"),
    ("top", "top_k", "experts_per_token"), ("top", "gate", "gate_mode"),
])
def test_other_tools_names_for_our_keys_are_typos(where, key, hint):
    """mergekit-moe drops these silently (then routes without the prompts); they are errors even with
    --allow-unknown-keys."""
    data = {"base_model": "org/base", "gate_mode": "cheap_embed",
            "experts": [{"source_model": "org/a", "positive_prompts": ["a"]},
                        {"source_model": "org/b", "positive_prompts": ["b"]}]}
    (data["experts"][0] if where == "expert" else data)[key] = "x"
    with pytest.raises(UpcycleError) as info:
        load_config(data, allow_unknown_keys=True)
    assert f"unknown key — did you mean {hint}?" in str(info.value)


def test_yaml_merge_keys_inside_experts_read_as_yaml_says(tmp_path):
    """``<<: *anchor`` (a YAML merge key) inside an expert: later keys override the merged ones, as in mergekit."""
    path = tmp_path / "merge.yaml"
    path.write_text("base_model: org/base\ngate_mode: cheap_embed\nexperts:\n"
                    "  - &first\n    source_model: org/a\n    positive_prompts: [chat]\n    negative_prompts: [code]\n"
                    "  - <<: *first\n    source_model: org/b\n    positive_prompts: [code]\n", encoding="utf-8")
    config = load_config(path)
    assert [(e.source_model, e.positive_prompts, e.negative_prompts) for e in config.experts] == [
        ("org/a", ["chat"], ["code"]), ("org/b", ["code"], ["code"])]


# ---------------------------------------------------------------------------------------------
# Round 2: what the new published configs exercise beyond "builds" / "refused"


def _state(folder: Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for shard in folder.glob("*.safetensors"):
        state.update(load_file(str(shard)))
    return state


def test_qwen_shared_expert_residual_scale_as_mergekit_writes_it(published, tmp_path):
    """Aoyinke's card: random gates, `positive_prompts: []` and residual_scale 0.1 on the shared expert.

    The shared expert is the dense MLP with down_proj scaled by 0.1 in the source's fp32 and rounded to
    bf16 once: the bytes mergekit-moe 0.1.5 writes (scaling the bf16 copy rounded twice, one ulp off in a
    fifth of the values); both routed experts are the dense MLP.
    """
    config = load_config(published("aoyinke_qwen2_random_shared_empty_prompts"))
    assert [e.positive_prompts for e in config.shared_experts] == [[]]
    out = upcycle(published("aoyinke_qwen2_random_shared_empty_prompts"), tmp_path / "out", checksums=False).output
    state, dense = _state(out), _state(resolve_model("Qwen/Qwen2-7B", "base_model"))
    for layer in range(2):
        mlp = f"model.layers.{layer}.mlp"
        down = dense[f"{mlp}.down_proj.weight"]
        assert torch.equal(state[f"{mlp}.shared_expert.down_proj.weight"], (down * 0.1).to(torch.bfloat16))
        for e in range(2):
            assert torch.equal(state[f"{mlp}.experts.{e}.down_proj.weight"], down.to(torch.bfloat16))
        assert state[f"{mlp}.gate.weight"].shape == (2, down.shape[0])


def test_key_with_a_space_before_its_colon_reads_as_the_key():
    """femiari's card writes `base_model : Qwen/Qwen2-1.5B`; YAML (and mergekit-moe) read the key `base_model`."""
    config = load_config(PUBLISHED / "femiari_qwen2_space_before_colon.yaml")
    assert config.base_model == "Qwen/Qwen2-1.5B" and config.gate_mode == "hidden"
    assert config.shared_experts[0].residual_scale == 0.1 and config.architecture == "qwen"


def test_korean_prompts_and_tokenizer_source_base_build(published, tmp_path):
    """`tokenizer_source: base` asks for what every MoE gets, base_model's tokenizer: read, not refused (as by
    mergekit-moe); the Korean cheap_embed prompts give two distinct router rows."""
    config = load_config(PUBLISHED / "solar_korean_tokenizer_source.yaml")
    assert config.gate_mode == "cheap_embed" and config.experts[0].positive_prompts == ["당신은 친절한 보편적인 어시스턴트이다."]
    out = upcycle(published("solar_korean_tokenizer_source"), tmp_path / "out", checksums=False).output
    rows = _state(out)["model.layers.0.block_sparse_moe.gate.weight"].float()
    assert torch.isfinite(rows).all() and torch.nn.functional.cosine_similarity(rows[0], rows[1], dim=0) < 0.99


@pytest.mark.parametrize("extra, refused", [
    ("tokenizer_source: base\n", False), ("tokenizer_source: BASE\n", False), ("tokenizer:\n  source: base\n", False),
    ("tokenizer_source: union\n", True), ("tokenizer:\n  source: base\n  tokens: {}\n", True),
    ("tokenizer_source: org/other-model\n", True),
])
def test_only_a_tokenizer_choice_we_honour_is_read(extra, refused, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base_model: org/x\ngate_mode: random\nexperts:\n  - source_model: a/b\n  - source_model: c/d\n"
                    + extra, encoding="utf-8")
    if refused:
        with pytest.raises(UpcycleError, match="unknown key — the MoE gets base_model's tokenizer"):
            load_config(path)
    else:
        assert load_config(path).base_model == "org/x"


@pytest.mark.parametrize("name, noted", [
    ("hai_ser_same_model_twice_cheap_embed", True), ("tiny_mistral_4x_comments", True),
    ("minicpm_x4_random_same_model", False),  # random routers: nothing is claimed for them
    ("aegolius_v1_5x_negatives_case_variants", False), ("femiari_qwen2_space_before_colon", False),
])
def test_plan_says_when_every_expert_is_one_unchanged_model(name, noted, published):
    """mergekit-moe refuses prompted gates over copies of one model; we build them and say what the routers do."""
    notes = upcycle(published(name), dry_run=True).plan.notes
    said = [n for n in notes if n.startswith("every expert is ")]
    assert bool(said) == noted, notes
    if noted:
        assert "the MoE gives the dense model's output whichever experts" in said[0]
        assert "--i-understand-this-is-not-useful-without-training" in said[0]


@pytest.mark.parametrize("prompts, read", [
    ('      - "Dialogue:\n      \u2013 Hello, said the cat.\n      \u2013 Hi, said the dog."',
     ["Dialogue: \u2013 Hello, said the cat. \u2013 Hi, said the dog."]),
    ('      - "A quote from the book:\n      \u00b7 chapter one"', ["A quote from the book: \u00b7 chapter one"]),
    ("      [Write a dialogue,\n      \u2013 Hello, said the cat.]", ["Write a dialogue", "\u2013 Hello", "said the cat."]),
    ("      - |\n        Dialogue:\n        \u2013 Hello", ["Dialogue:\n\u2013 Hello\n"]),
])
def test_dialogue_dashes_inside_a_prompt_are_text_not_bullets(prompts, read, tmp_path):
    """A dash or dot that starts a line inside a quoted prompt, a flow list or a block scalar is the prompt's text
    (dialogue as French or Russian write it); only lines that are all bullets under the key are a pasted list.
    (The bullet check refused these with "write - Hello, said the cat.", which would have broken the quote.)"""
    path = tmp_path / "dialogue.yaml"
    path.write_text(f"base_model: org/base\ngate_mode: hidden\nexperts:\n  - source_model: org/base\n"
                    f"    positive_prompts:\n{prompts}\n  - source_model: org/other\n    positive_prompts: [b]\n",
                    encoding="utf-8")
    assert load_config(path).experts[0].positive_prompts == read
