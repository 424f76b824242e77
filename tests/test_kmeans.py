"""k-means gates: seeded, deterministic, every expert gets a non-empty cluster; calibration files."""

from __future__ import annotations

import json

import pytest
import torch

import gate_oracle as oracle
from moe_upcycle.gates import hidden_gates as hg
from moe_upcycle.recipe.calibration import read_documents
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.errors import ConfigError
from moe_upcycle.gates.kmeans import spherical_kmeans
from moe_upcycle.recipe.resolve import gate_params
from routing_prompts import CODE, STORY


def test_spherical_kmeans_recovers_directions_deterministically():
    gen = torch.Generator().manual_seed(1)
    centers = torch.nn.functional.normalize(torch.randn(4, 16, generator=gen), dim=-1)
    labels = torch.arange(200) % 4
    points = (centers[labels] + 0.05 * torch.randn(200, 16, generator=gen)) * (1 + torch.rand(200, 1, generator=gen))
    a, b = spherical_kmeans(points, 4, seed=7), spherical_kmeans(points, 4, seed=7)
    assert torch.equal(a.assignment, b.assignment) and torch.equal(a.centroids, b.centroids)
    assert sorted(a.sizes.tolist()) == [50, 50, 50, 50]
    # each found cluster is exactly one true cluster
    for c in range(4):
        assert labels[a.assignment == c].unique().numel() == 1


def test_every_cluster_non_empty_even_when_points_pile_up():
    points = torch.cat([torch.tensor([[1.0, 0.0, 0.0]]).repeat(97, 1),
                        torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.7, 0.7, 0.0]])])
    clusters = spherical_kmeans(points, 4, seed=0)
    assert clusters.sizes.min() >= 1 and int(clusters.sizes.sum()) == 100
    with pytest.raises(ValueError, match="only 4 distinct token directions for 5 clusters"):
        spherical_kmeans(points, 5, seed=0)


def test_read_documents_txt_jsonl_folder(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nstill first\n\nsecond doc\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"text": "third"}) + "\n\n" + json.dumps("fourth") + "\n")
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    assert read_documents(tmp_path) == ["first doc\nstill first", "second doc", "third", "fourth"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": 3}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: expected a JSON string or an object with a \"text\""):
        read_documents(bad)


def test_calibration_text_saved_on_windows_gives_the_same_documents(tmp_path):
    """CRLF line ends used to stay inside each document (a \r token before every line break)."""
    unix, windows = tmp_path / "unix.txt", tmp_path / "windows.txt"
    text = "first doc\nstill first\n\nsecond doc\n"
    unix.write_bytes(text.encode())
    windows.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    assert read_documents(windows) == read_documents(unix) == ["first doc\nstill first", "second doc"]


def _kmeans_config(stories, corpus, seed=0, n=4):
    return load_config({"base_model": str(stories), "num_experts": n, "gate_mode": "kmeans", "device": "cpu",
                        "calibration_text": str(corpus), "seed": seed, "batch_size": 8})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "corpus.txt"
    path.write_text("\n\n".join(CODE + STORY), encoding="utf-8")
    return path


def test_kmeans_gates_deterministic_and_every_expert_routed(stories, corpus):
    cfg = _kmeans_config(stories, corpus)
    first = hg.compute_hidden_gates(gate_params(cfg), 5, stories)
    again = hg.compute_hidden_gates(gate_params(cfg), 5, stories)
    for layer in range(5):
        assert torch.equal(first[layer], again[layer])
    # route the calibration tokens with the gate rows: every expert is top-1 for some tokens (router inputs from
    # transformers' whole model, each document alone: the MLP's input of every real token)
    model, tokenizer = oracle.load_dense(stories)
    counts = torch.zeros(5, 4, dtype=torch.long)
    tokens = 0
    for doc in read_documents(corpus):
        for layer, x in enumerate(oracle.router_inputs(model, tokenizer, doc)):  # (T_real, H) float64
            counts[layer] += torch.bincount((x @ first[layer].double().T).argmax(dim=-1), minlength=4)
        tokens += x.shape[0]
    assert counts.min() >= 1, counts
    assert int(counts[0].sum()) == tokens


def test_kmeans_needs_calibration_text(stories):
    with pytest.raises(ConfigError, match="gate_mode kmeans needs calibration_text"):
        load_config({"base_model": str(stories), "num_experts": 2, "gate_mode": "kmeans"})


def test_kmeans_too_little_text_is_named(stories, tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Hi", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"calibration_text: .*tiny.txt gives 2 tokens; layer 0: .*add more text"):
        hg.compute_hidden_gates(gate_params(_kmeans_config(stories, tiny, n=4)), 5, stories)
