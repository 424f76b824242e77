"""Routing evaluation: accuracy and confusion from top-1 routing, labels from embeddings, stories260K MoE."""

from __future__ import annotations

import pytest
import torch

from moe_upcycle import upcycle
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.errors import ConfigError
from moe_upcycle.check.route import route
from moe_upcycle.check.route_eval import label_by_embedding, labels_for, read_labeled, routing_accuracy
from moe_upcycle.recipe.resolve import expert_prompts


def test_accuracy_and_confusion_from_hard_assignments():
    # 4 prompts x 3 layers; labels a, a, b, c
    top1 = torch.tensor([[0, 0, 1],
                         [0, 2, 2],
                         [1, 1, 1],
                         [0, 2, 2]])
    score = routing_accuracy(top1, ["a", "a", "b", "c"], ["a", "b", "c"])
    assert score.layer_accuracy == pytest.approx([3 / 4, 3 / 4, 2 / 4])
    assert score.overall == pytest.approx(8 / 12)
    # majority over layers: prompt 0 -> a, prompt 1 -> c, prompt 2 -> b, prompt 3 -> c
    assert score.confusion.tolist() == [[1, 0, 1], [0, 1, 0], [0, 0, 1]]
    assert score.label_counts == [2, 1, 1]
    assert score.layer_confusion[1].tolist() == [[1, 0, 1], [0, 1, 0], [0, 0, 1]]
    assert score.layer_confusion[0].tolist() == [[2, 0, 0], [0, 1, 0], [1, 0, 0]]
    assert (score.layer_confusion.sum(-1) == torch.tensor([2, 1, 1])).all()


def test_unknown_labels_are_all_reported():
    with pytest.raises(ConfigError) as err:
        routing_accuracy(torch.zeros(3, 2, dtype=torch.long), ["a", "z", "q"], ["a", "b"])
    assert err.value.problems == ["labels[1]: 'z' is not an expert; expected one of a, b",
                                  "labels[2]: 'q' is not an expert; expected one of a, b"]
    with pytest.raises(ConfigError, match="2 labels for 3 prompts"):
        routing_accuracy(torch.zeros(3, 2, dtype=torch.long), ["a", "b"], ["a", "b"])


def test_read_labeled_csv_and_tsv_with_a_header(tmp_path):
    """A spreadsheet export: before, each row was read as one unlabeled prompt ("code,Write a C function")."""
    csv_file = tmp_path / "labels.csv"
    csv_file.write_text('Expert,Prompt\ncode,Write a C function\nmath,"Integrate x^2, then check"\n,unlabeled\n')
    assert read_labeled(csv_file) == (["Write a C function", "Integrate x^2, then check", "unlabeled"],
                                      ["code", "math", None])
    tsv = tmp_path / "labels.tsv"
    tsv.write_text("text\tlabel\nWrite a C function\tcode\n")
    assert read_labeled(tsv) == (["Write a C function"], ["code"])
    bad = tmp_path / "bad.csv"
    bad.write_text("id,expert\n1,code\n")
    with pytest.raises(ConfigError, match="its header row names no \"text\" or \"prompt\" column \\(columns: 'id', "
                                          "'expert'\\)"):
        read_labeled(bad)


def test_read_labeled_json_list(tmp_path):
    """A .json list of records was read line by line as JSONL: "not valid JSON" on its second line."""
    import json

    path = tmp_path / "labels.json"
    path.write_text(json.dumps([{"text": "Write a C function", "expert": "code"}, {"prompt": "Integrate x^2"}],
                               indent=2))
    assert read_labeled(path) == (["Write a C function", "Integrate x^2"], ["code", None])
    inst = tmp_path / "inst.txt"  # a prompt line that starts with '[' is still a prompt line
    inst.write_text("code\t[INST] Write a C function [/INST]\n[INST] Integrate x^2 [/INST]\n")
    assert read_labeled(inst) == (["[INST] Write a C function [/INST]", "[INST] Integrate x^2 [/INST]"],
                                  ["code", None])
    bad = tmp_path / "bad.json"
    bad.write_text('[{"expert": "code"}]')
    with pytest.raises(ConfigError, match="bad.json: item 0: no prompt text"):
        read_labeled(bad)


def test_read_labeled_formats(tmp_path):
    path = tmp_path / "labeled.jsonl"
    path.write_text('{"text": "Write a C function", "expert": "code"}\n\n{"prompt": "Integrate x^2"}\n'
                    'math\tWhat is 2 + 2?\nplain prompt\n')
    assert read_labeled(path) == (["Write a C function", "Integrate x^2", "What is 2 + 2?", "plain prompt"],
                                  ["code", None, "math", None])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"expert": "code"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1: no prompt text"):
        read_labeled(bad)


def test_label_by_embedding_nearest_centroid(tiny_llama):
    import yaml
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "gate_configs/prompts"
    config = load_config({"base_model": str(tiny_llama), "experts": [
        {"source_model": str(tiny_llama), "name": name,
         "positive_prompts": yaml.safe_load((root / f"{name}.yaml").read_text())["prompts"]}
        for name in ("code", "math", "creative")]})
    prompts = ["How do I reverse a string in Rust?", "What is the integral of sin(x)?",
               "Tell me a fairy tale about a princess and a frog.",
               "Write a Python function that checks whether a number is prime.", "Write a poem about the sea."]
    assert label_by_embedding(prompts, expert_prompts(config.expert_list())) == ["code", "math", "creative", "code", "creative"]
    with pytest.raises(ConfigError, match=r"experts\[0\].positive_prompts: needed to label prompts by embedding"):
        label_by_embedding(prompts, expert_prompts(load_config({"base_model": str(tiny_llama), "num_experts": 2}).expert_list()))


STORY_EXPERTS = {
    "animals": ["The cat and the dog played in the park.", "The little bird sang in the tree.",
                "A big fish swam in the pond."],
    "food": ["Mom made a big cake for Lily.", "Tom ate an apple and some bread.", "They had soup and cookies."],
}
STORY_PROMPTS = [("The dog ran after the cat.", "animals"), ("A bird flew over the tree.", "animals"),
                 ("The fish jumped out of the water.", "animals"), ("Lily ate a cookie.", "food"),
                 ("Mom gave Tom some cake and milk.", "food")]


def test_stories_moe_confusion_rows_sum_to_label_counts(stories, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = {"base_model": str(stories), "gate_mode": "cheap_embed", "experts_per_token": 1, "dtype": "float32",
              "experts": [{"source_model": str(stories), "name": k, "positive_prompts": v}
                          for k, v in STORY_EXPERTS.items()]}
    result = upcycle(config, tmp_path / "moe")
    model = AutoModelForCausalLM.from_pretrained(str(result.output), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(result.output))
    prompts, labels = [p for p, _ in STORY_PROMPTS], [lab for _, lab in STORY_PROMPTS]
    routed = route(result.output, prompts, device="cpu", batch_size=2)  # padded batches of 2, 2 and 1
    assert routed.expert_names == list(STORY_EXPERTS)
    shares = routed.shares().float()
    assert shares.shape == (5, 5, 2)  # 5 prompts, 5 layers, 2 experts
    torch.testing.assert_close(shares.sum(-1), torch.ones(5, 5))
    # the same shares, one prompt at a time (no padding), straight from the model's router logits
    for i, prompt in enumerate(prompts):
        enc = tok(prompt, return_tensors="pt", return_special_tokens_mask=True)
        real = enc.pop("special_tokens_mask")[0] == 0  # route counts real tokens only (no BOS)
        with torch.inference_mode():
            logits = model(**enc, output_router_logits=True).router_logits
        want = torch.stack([torch.bincount(layer[real].argmax(-1), minlength=2).float() / int(real.sum())
                            for layer in logits])
        torch.testing.assert_close(shares[i], want)
    score = routing_accuracy(shares, labels, list(STORY_EXPERTS))
    assert score.confusion.sum(1).tolist() == [3, 2]
    assert (score.layer_confusion.sum(-1) == torch.tensor([3, 2])).all()
    hit = shares[torch.arange(5), :, torch.tensor([0, 0, 0, 1, 1])]  # (P, L)
    assert score.layer_accuracy == pytest.approx(hit.mean(0).tolist())
    assert score.overall == pytest.approx(float(hit.mean()))
    # labels from embeddings agree with the hand labels on these clear-cut prompts
    assert label_by_embedding(prompts, expert_prompts(load_config(config).expert_list())) == labels
    assert labels_for(prompts, [None, "animals", None, None, "food"], expert_prompts(load_config(config).expert_list()), "embedding") == labels


def test_routing_tables_render_accuracy_and_confusion():
    from rich.console import Console

    from moe_upcycle.cli.tables import routing_tables

    score = routing_accuracy(torch.tensor([[0, 0], [1, 0], [1, 1]]), ["a", "b", "b"], ["a", "b"])
    console = Console(record=True, width=120)
    for table in routing_tables(score):
        console.print(table)
    text = console.export_text()
    assert "(overall 83.3%)" in text  # layer 0: 3 of 3 prompts hit, layer 1: 2 of 3
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[2:-1]] for ln in text.splitlines()
            if ln.startswith("│")}
    assert rows["0"] == ["100.0%"] and rows["1"] == ["66.7%"]
    assert rows["a"] == ["1", "0", "1"] and rows["b"] == ["1", "1", "2"]  # prompt [1, 0] ties -> a


def test_route_labeled_cli_reports_accuracy_and_confusion(stories, tmp_path):
    """`route OUT --labeled FILE` on a stories260K MoE: rows of the confusion matrix sum to the prompts per label,
    and --label-by embedding fills the prompts that have no label."""
    import json

    from typer.testing import CliRunner

    from moe_upcycle.cli import app

    config = {"base_model": str(stories), "gate_mode": "cheap_embed", "experts_per_token": 1,
              "experts": [{"source_model": str(stories), "name": k, "positive_prompts": v}
                          for k, v in STORY_EXPERTS.items()]}
    out = upcycle(config, tmp_path / "moe").output
    labeled = tmp_path / "labeled.txt"
    labeled.write_text("animals\tThe dog ran after the cat.\nanimals\tA bird flew over the tree.\n"
                       "The fish jumped out of the water.\nfood\tLily ate a cookie.\nfood\tMom gave Tom some cake and milk.\n")
    runner = CliRunner()
    res = runner.invoke(app, ["route", str(out), "--labeled", str(labeled)])
    assert res.exit_code == 1 and "no label" in res.output and "--label-by embedding" in " ".join(res.output.split())
    res = runner.invoke(app, ["route", str(out), "--labeled", str(labeled), "--label-by", "embedding", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    acc = data["accuracy"]
    assert [sum(row) for row in acc["confusion"]] == [3, 2]
    assert len(acc["layer_accuracy"]) == 5 and 0.0 <= acc["overall"] <= 1.0
    res = runner.invoke(app, ["route", str(out), "--labeled", str(labeled), "--label-by", "embedding"])
    assert res.exit_code == 0 and "confusion" in res.output.lower()


def test_label_by_embedding_with_a_recorded_prompt_file_gone_fails_before_routing(stories, tmp_path, monkeypatch):
    """Before: after loading and routing, "config error: config: experts[0].positive_prompts_from: ..."; now the
    message says it is the recorded recipe, where it looked (the file recorded relative to the output) and what to
    do, before any routing work."""
    from typer.testing import CliRunner

    import moe_upcycle.check.route as route_module
    from moe_upcycle.cli import app

    (tmp_path / "animals.txt").write_text("The dog ran after the cat.\nA bird flew over the tree.\n")
    monkeypatch.chdir(tmp_path)
    config = {"base_model": str(stories), "gate_mode": "random", "experts": [
        {"source_model": str(stories), "name": "animals", "positive_prompts_from": "animals.txt"},
        {"source_model": str(stories), "name": "food", "positive_prompts": ["Lily ate a cookie."]}]}
    out = upcycle(config, tmp_path / "moe").output
    (tmp_path / "animals.txt").unlink()
    labeled = tmp_path / "labeled.txt"
    labeled.write_text("The fish jumped out of the water.\nfood\tMom gave Tom some cake.\n")
    monkeypatch.setattr(route_module, "route", lambda *a, **k: pytest.fail("routed before the labels were known"))
    res = CliRunner().invoke(app, ["route", str(out), "--labeled", str(labeled), "--label-by", "embedding"])
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert (f"--label-by embedding: the recipe {out}/moe_upcycle.json records no longer loads "
            f"(experts[0].positive_prompts_from: '{tmp_path / 'animals.txt'}' is neither a prompt set") in said, said
    assert "give every prompt in --labeled its expert" in said
