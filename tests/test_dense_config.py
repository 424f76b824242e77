"""The typed view of a base's config.json (issue 35): every field the tool reads is checked once, where config.json
is read; a wrong JSON type in any of them is a SourceError naming the file, the field, the value and the fix, never
a traceback (``"torch_dtype": []`` was ``TypeError: unhashable type: 'list'`` in the planner)."""

from __future__ import annotations

import json
import math

import pytest

from moe_upcycle import upcycle
from moe_upcycle.checkpoint.config_checks import CHECKED_FIELDS
from moe_upcycle.checkpoint.dense_config import REQUIRED_INT_FIELDS, DenseConfig, dense_config
from moe_upcycle.checkpoint.meta_model import describe_dense
from moe_upcycle.checkpoint.source import meta_checkpoint
from moe_upcycle.errors import SourceError, UpcycleError
from moe_upcycle.planning.model_config import moe_config
from moe_upcycle.planning.plan import make_plan
from moe_upcycle.planning.runtimes import compatibility
from moe_upcycle.recipe.schema import load_config

# every JSON type, and values of the right type but out of bounds
HOSTILE = [[], {}, [[]], {"a": []}, [1, "a"], "x", "", 1.5, -3, 0, True, False, math.nan, math.inf, 2**70,
           {"rope_type": []}, {"type": "linear", "factor": []}, {"type": "linear", "factor": 2.0, "a": -math.inf}]
FIELDS = sorted(CHECKED_FIELDS | set(REQUIRED_INT_FIELDS))


@pytest.fixture(scope="module")
def raw(tiny_llama) -> dict:
    return json.loads((tiny_llama / "config.json").read_text())


@pytest.mark.parametrize("field", FIELDS)
def test_every_checked_field_refuses_every_wrong_json_type_by_name(field, raw):
    """Each value is refused with a message naming the file, the field, the value and what to write, or accepted;
    an accepted one plans, writes its config.json and is judged for every runtime without a traceback."""
    refused = 0
    for value in HOSTILE:
        try:
            view = dense_config({**raw, field: value}, "base/config.json")
        except SourceError as exc:
            refused += 1
            named = [p for p in exc.problems if p.startswith(f"base/config.json: {field}")]
            assert named, (value, exc.problems)
            assert all(";" in p for p in exc.problems), exc.problems  # what is wrong; what to do
            continue
        _plan_and_write(view)
    assert refused >= 3, field  # at least three JSON types are wrong for every field


def _plan_and_write(view: DenseConfig) -> None:
    """Plan a 2-expert MoE of the config's shapes, write its config.json and judge its runtimes (no files)."""
    try:
        sources = {"base": meta_checkpoint("base", view, describe_dense(view))}
        plan = make_plan(load_config({"base_model": "base", "num_experts": 2, "gate_mode": "random"}), sources)
    except UpcycleError:
        return  # a named refusal (an unsupported family, a window layout the output cannot hold)
    written = json.loads(json.dumps(moe_config(plan), allow_nan=False))  # no NaN or inf reaches the output
    assert written["num_local_experts"] == 2
    # and transformers 5, whose configs are typed, reads it (a null max_position_embeddings, a list as bos_token_id
    # or an integer initializer_range were copied into an output it refused)
    from transformers import AutoConfig

    kwargs = {k: v for k, v in written.items() if k not in ("model_type", "architectures")}
    assert AutoConfig.for_model(written["model_type"], **kwargs).num_local_experts == 2
    # every runtime judged, in the report's order, each verdict one of the three words and explained unless exact;
    # transformers 5 (which just read the config above) computes what the plan wrote
    verdicts = compatibility(plan)
    assert [v.runtime for v in verdicts] == ["transformers 5", "transformers 4.x", "vLLM", "llama.cpp", "ExLlamaV2"]
    assert all(v.status in ("exact", "runs, not exact", "will not load") for v in verdicts), verdicts
    assert all(v.why for v in verdicts if v.status != "exact"), verdicts
    assert verdicts[0].status == "exact", verdicts[0]


def test_the_reported_examples_are_named_through_the_cli(tiny_llama, tmp_path):
    """The examples of the issue, through `build`: exit 1, the file, field, value and fix, nothing written."""
    from failure_checks import assert_clean_failure, cli

    for name, value in (("torch_dtype", []), ("torch_dtype", {}), ("dtype", ["bfloat16"])):
        base = tmp_path / f"base_{name}_{type(value).__name__}"
        base.mkdir()
        for f in tiny_llama.iterdir():
            (base / f.name).write_bytes(f.read_bytes())
        cfg = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({**cfg, name: value}))
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"base_model: {base}\nnum_experts: 2\ngate_mode: random\n")
        code, output = cli("build", recipe, tmp_path / "moe")
        assert_clean_failure(code, output, tmp_path / "moe", [
            f"{base}/config.json: {name} must be a dtype name such as \"bfloat16\", got {value!r}; write the dtype "
            f"the weights are stored in, or remove the key"])
        code, output = cli("plan", "--from-config", recipe)  # the plan of config.json alone reads it the same way
        assert code == 1 and f"{name} must be a dtype name" in " ".join(output.split()), output


def test_an_in_memory_models_config_is_checked_the_same_way(stories):
    """`upcycle_model` reads model.config through the same view: a field of the wrong type is named, not a
    traceback (transformers 5 types its own fields on assignment; a config made otherwise, or by 4.x, may not)."""
    from transformers import AutoModelForCausalLM

    from moe_upcycle import upcycle_model

    dense = AutoModelForCausalLM.from_pretrained(str(stories))
    dense.config.__dict__["eos_token_id"] = "</s>"  # past transformers 5's own check
    with pytest.raises(SourceError, match=r"^dense_model.config: eos_token_id must be a token id \(an integer\) or a "
                                          r"list of them, got '</s>'; write the id\(s\), or null$"):
        upcycle_model(dense, num_experts=2)


def test_every_field_a_build_reads_from_config_json_is_a_checked_one(tiny_llama, tiny_mistral, tiny_qwen2,
                                                                     tiny_qwen3, stories, tmp_path, monkeypatch):
    """The class, not the examples: every field the planner, gates, writer, runtime report and verify read from a
    base's config.json (recorded as they read it) is one `dense_config` checks. A new read of an unchecked field
    fails here until the field gets its check."""
    read: set[str] = set()
    original = DenseConfig.__getitem__

    def recording(self, key):
        read.add(key)
        return original(self, key)

    monkeypatch.setattr(DenseConfig, "__getitem__", recording)
    cases = [(tiny_llama, {}), (tiny_mistral, {"architecture": "qwen2_moe"}),
             (tiny_qwen2, {"shared_experts": [{"source_model": str(tiny_qwen2)}]}),
             (tiny_qwen3, {"expert_init": {"method": "split", "granularity": 2}}),
             (stories, {"expert_init": {"method": "drop", "ratio": 0.5}, "layout": "fused"})]
    for i, (base, extra) in enumerate(cases):
        result = upcycle({"base_model": str(base), "num_experts": 4, "gate_mode": "random", **extra},
                         tmp_path / f"moe{i}", verify=i == 0)
        assert result.output.is_dir() and (i or result.verify.ok)
    assert read, "nothing recorded: the stages no longer read the view"
    unchecked = read - CHECKED_FIELDS - set(REQUIRED_INT_FIELDS)
    assert not unchecked, f"fields read without a type check: {sorted(unchecked)}"
