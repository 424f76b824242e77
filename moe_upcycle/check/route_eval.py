"""Routing evaluation: does a built MoE send each prompt to the expert it was meant for?

Given which expert each prompt's tokens pick first (top-1) in every layer, and a label per
prompt (the expert it should go to), computes routing accuracy per layer and overall, and
confusion matrices (rows: label, columns: expert chosen). Labels come from a labelled file
(`read_labeled`) or, for unlabelled prompts, from the nearest expert centroid in embedding space
(`label_by_embedding`). The routing itself comes from `route.route` (`RoutingResult.shares()`).

Shapes: P prompts, L layers, E experts. "Shares" are (P, L, E): the fraction of a prompt's real
(unpadded) tokens whose top-1 expert in layer l is e; each (p, l) row sums to 1. Hard
assignments (P, L) of expert indices are accepted too and count as shares of 0 or 1.

It does not print anything; `prompt_cli.routing_tables` renders a `RoutingScore`.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from moe_upcycle.recipe.params import ExpertPrompts
from moe_upcycle.gates.self_check import majority_expert
from moe_upcycle.prompts.embed import Embedder, load_embedder
from moe_upcycle.errors import ConfigError
from moe_upcycle.inputs.records import is_json_list, json_document, json_line, table_rows
from moe_upcycle.inputs.text import read_utf8


@dataclass(frozen=True)
class RoutingScore:
    """Routing accuracy and confusion of labelled prompts.

    Attributes:
        expert_names: the E experts, in router order.
        layer_accuracy: per layer, mean over prompts of the share of tokens routed top-1 to the label.
        overall: mean of `layer_accuracy`.
        confusion: (E, E) int; row = label, column = expert with the largest share summed over
            layers (ties go to the lower index: `self_check.majority_expert`, which the build's routing
            self-check counts with too). Row i sums to the number of prompts labelled i.
        layer_confusion: (L, E, E) int; the same per layer.
        layers: the model layer of each of the L rows (only MoE layers route, ``moe_layers:``); None: 0 to L-1.
    """

    expert_names: list[str]
    layer_accuracy: list[float]
    overall: float
    confusion: torch.Tensor
    layer_confusion: torch.Tensor
    layers: Optional[list[int]] = None

    @property
    def layer_indices(self) -> list[int]:
        """The model layer of each `layer_accuracy` entry."""
        return list(self.layers) if self.layers is not None else list(range(len(self.layer_accuracy)))

    @property
    def label_counts(self) -> list[int]:
        """Prompts per label (row sums of the confusion matrix)."""
        return self.confusion.sum(1).tolist()

    def to_dict(self) -> dict:
        return {"experts": self.expert_names, "layer_accuracy": self.layer_accuracy, "overall": self.overall,
                "confusion": self.confusion.tolist(), "layer_confusion": self.layer_confusion.tolist(),
                "layers": self.layer_indices}


def routing_accuracy(routing: torch.Tensor, labels: Sequence[Union[str, int]],
                     expert_names: Sequence[str], layers: Optional[Sequence[int]] = None) -> RoutingScore:
    """Score routing against labels.

    Args:
        routing: (P, L, E) shares, or (P, L) integer top-1 expert per prompt and layer.
        labels: per prompt, the expert it should go to (name or index).
        expert_names: the experts in router order.
        layers: the model layer of each of the L routing rows (`route.RoutingResult.layers`); default 0 to L-1.

    Returns:
        Accuracy per layer and overall, and the confusion matrices.

    Raises:
        ConfigError: a label that is not an expert, or a count mismatch.

    Example:
        >>> s = routing_accuracy(torch.tensor([[0, 0, 0], [1, 1, 0]]), ["a", "b"], ["a", "b"])
        >>> s.layer_accuracy, s.confusion.tolist()
        ([1.0, 1.0, 0.5], [[1, 0], [0, 1]])
    """
    names = list(expert_names)
    e = len(names)
    if routing.dim() == 2:
        routing = torch.nn.functional.one_hot(routing.long(), e).float()
    if routing.dim() != 3 or routing.shape[-1] != e:
        raise ConfigError(f"routing: expected (prompts, layers, {e}) shares or (prompts, layers) expert indices, "
                          f"got shape {tuple(routing.shape)}")
    if len(labels) != routing.shape[0]:
        raise ConfigError(f"labels: {len(labels)} labels for {routing.shape[0]} prompts; give one label per prompt")
    idx = torch.tensor(label_indices(labels, names))  # (P,)
    p, n_layers, _ = routing.shape
    hit = routing[torch.arange(p), :, idx]  # (P, L): share routed to the label
    layer_acc = hit.mean(0).tolist() if p else [0.0] * n_layers
    layer_conf = torch.zeros(n_layers, e, e, dtype=torch.long)
    pred = routing.argmax(-1)  # (P, L)
    for layer in range(n_layers):
        layer_conf[layer].index_put_((idx, pred[:, layer]), torch.ones(p, dtype=torch.long), accumulate=True)
    conf = torch.zeros(e, e, dtype=torch.long)
    conf.index_put_((idx, majority_expert(routing)), torch.ones(p, dtype=torch.long), accumulate=True)
    overall = sum(layer_acc) / n_layers if n_layers else 0.0
    return RoutingScore(names, layer_acc, overall, conf, layer_conf, None if layers is None else list(layers))


def label_indices(labels: Sequence[Union[str, int]], expert_names: Sequence[str],
                  prompts: Optional[Sequence[str]] = None, where: str = "labels") -> list[int]:
    """Map labels (names or indices) to expert indices; every unknown label is reported at once.

    With `prompts` (and `where`, e.g. ``--labeled labels.csv``) each problem names its prompt, and a label that
    is an expert's name but for letter case or spaces says which expert it means.
    """
    lookup = {n: i for i, n in enumerate(expert_names)}
    loose = {" ".join(n.split()).casefold(): n for n in expert_names}
    out, bad = [], []
    for n, label in enumerate(labels):
        if isinstance(label, int) and 0 <= label < len(expert_names):
            out.append(label)
        elif label in lookup:
            out.append(lookup[label])
        else:
            meant = loose.get(" ".join(str(label).split()).casefold())
            which = (f"{where}: prompt {n + 1} ({_short(prompts[n])}) has label {label!r}, which" if prompts is not None
                     else f"{where}[{n}]: {label!r}")
            bad.append(f"{which} is not an expert; {f'did you mean {meant}? ' if meant else ''}"
                       f"expected one of {', '.join(expert_names)}")
    if bad:
        raise ConfigError(*bad)
    return out


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


def label_by_embedding(prompts: Sequence[str], experts: Sequence[ExpertPrompts],
                       embedder: Optional[Embedder] = None) -> list[str]:
    """Label each prompt with the expert whose prompt centroid is nearest in embedding space.

    The centroid is the normalised mean embedding of the expert's positive prompts.

    Raises:
        ConfigError: some routed expert has no positive prompts (it could never be a label).
    """
    missing = [f"experts[{i}].positive_prompts: needed to label prompts by embedding; add prompts or give "
               f"labels in the prompts file" for i, e in enumerate(experts) if not e.positive]
    if missing:
        raise ConfigError(*missing)
    embedder = embedder or load_embedder()
    texts = [p for e in experts for p in e.positive] + list(prompts)
    vecs = embedder.encode(texts)  # one batched call
    centroids, at = [], 0
    for e in experts:
        c = vecs[at:at + len(e.positive)].mean(0)
        centroids.append(c / c.norm().clamp_min(1e-12))
        at += len(e.positive)
    nearest = (vecs[at:] @ torch.stack(centroids).T).argmax(-1)  # (P,)
    return [experts[i].name for i in nearest.tolist()]


def read_labeled(path: Union[str, Path]) -> tuple[list[str], list[Optional[str]]]:
    """Read prompts and labels: JSONL (or a JSON list) of records with "text"/"prompt" and "expert"/"label",
    CSV/TSV (``.csv``, ``.tsv``) with a header row naming such columns or ``expert,prompt`` rows without one
    (`_labeled_table` says which is which), or plain text.

    Plain text is one prompt per line, optionally ``expert<TAB>prompt``. A prompt without a
    label gets None (to be filled by `label_by_embedding`).

    Raises:
        ConfigError: the file is missing, a folder or holds no prompt, or a line has no prompt
            (file and line named).
    """
    path = Path(path)
    prompts: list[str] = []
    labels: list[Optional[str]] = []
    problems = []
    content = read_utf8(path, f"--labeled {path}")
    if path.suffix.lower() in (".csv", ".tsv"):
        return _labeled_table(path, content, "\t" if path.suffix.lower() == ".tsv" else ",")
    if path.suffix.lower() == ".json" or content.lstrip().startswith("[") and is_json_list(content):
        return _labeled_list(path, content)  # not "[INST] ..." prompt lines
    for n, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            row, problem = json_line(path, n, line)
            if problem:
                problems.append(problem)
                continue
            text, label = row.get("text", row.get("prompt")), row.get("expert", row.get("label"))
        elif "\t" in line:
            label, text = line.split("\t", 1)
        else:
            label, text = None, line
        if not isinstance(text, str) or not text.strip():
            problems.append(f"{path}:{n}: no prompt text (JSONL needs a \"text\" or \"prompt\" field)")
            continue
        prompts.append(text.strip())
        labels.append(label.strip() if isinstance(label, str) and label.strip() else None)
    if not prompts and not problems:
        problems.append(f"--labeled {path}: holds no prompt; write `expert<TAB>prompt` lines or JSONL with "
                        f"\"text\" and \"expert\" fields")
    if problems:
        raise ConfigError(*problems)
    return prompts, labels


def labels_for(prompts: Sequence[str], labels: Sequence[Optional[str]],
               experts: Optional[Sequence[ExpertPrompts]], label_by: str) -> list[str]:
    """Fill missing labels: ``label_by="embedding"`` labels them by nearest expert centroid.

    Raises:
        ConfigError: prompts without labels and no way (or no recipe) to label them.
    """
    missing = [i for i, lab in enumerate(labels) if lab is None]
    if not missing:
        return list(labels)
    if label_by != "embedding":
        raise ConfigError(f"--labeled: {len(missing)} prompt(s) have no label (first: {prompts[missing[0]]!r}); "
                          f"write `expert<TAB>prompt` lines or JSONL with an \"expert\" field, or pass --label-by embedding")
    if experts is None:
        raise ConfigError("--label-by embedding needs the experts' prompts from the build's moe_upcycle.json, "
                          "which this folder lacks")
    guessed = label_by_embedding([prompts[i] for i in missing], experts)
    out = list(labels)
    for i, lab in zip(missing, guessed):
        out[i] = lab
    return out


TEXT_COLUMNS, LABEL_COLUMNS = ("text", "prompt"), ("expert", "label")


def _labeled_table(path: Path, text: str, delimiter: str) -> tuple[list[str], list[Optional[str]]]:
    """A CSV/TSV of labelled prompts, with a header row naming its columns or without one.

    The first row is a header when one of its cells names a column read here (text or prompt; expert or label):
    ``expert<TAB>text``. Otherwise every row is ``expert<TAB>prompt``, as in a text file. A two-cell first row that
    names only its second column (``code<TAB>prompt``) could be either, and is refused with the way to say which.
    """
    header, rows = table_rows(path, text, delimiter)
    cells = [h for h in header if h]
    if not any(h in TEXT_COLUMNS + LABEL_COLUMNS for h in cells):
        return _headerless_table(path, text, delimiter)
    if len(header) == 2 and header[0] not in TEXT_COLUMNS + LABEL_COLUMNS and header[1] in TEXT_COLUMNS:
        tab = "<TAB>" if delimiter == "\t" else ","
        raise ConfigError(f"--labeled {path}: its first row ({', '.join(repr(h) for h in header)}) is either a header "
                          f"or the prompt {header[1]!r} for expert {header[0]!r}; for a header, name the first column "
                          f"expert (or label); for labelled prompts, add the header row expert{tab}text above it")
    column = next((f for f in TEXT_COLUMNS if f in header), None)
    label = next((f for f in ("expert", "label") if f in header), None)
    if column is None:
        raise ConfigError(f"--labeled {path}: its header row names no \"text\" or \"prompt\" column (columns: "
                          f"{', '.join(repr(h) for h in header[:8]) or 'none'}); add one, and an \"expert\" column")
    kept = [row for row in rows if (row.get(column) or "").strip()]
    if not kept:
        raise ConfigError(f"--labeled {path}: holds no prompt under its {column!r} column")
    return ([row[column].strip() for row in kept],
            [((row.get(label) or "").strip() or None) if label else None for row in kept])


def _headerless_table(path: Path, text: str, delimiter: str) -> tuple[list[str], list[Optional[str]]]:
    """Rows of ``expert<TAB>prompt`` (``expert,prompt``) without a header: two cells each, as a text file's lines."""
    kind, shape = ("TSV", "expert<TAB>prompt") if delimiter == "\t" else ("CSV", "expert,prompt")
    prompts, labels, problems = [], [], []
    for n, row in enumerate(csv.reader(io.StringIO(text, newline=""), delimiter=delimiter), 1):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != 2 or not row[1].strip():
            quote = ", in double quotes when it holds a comma" if delimiter == "," else ""
            problems.append(f"{path}:{n}: {len(row)} cell(s) where a {kind} without a header row has two, {shape} "
                            f"(the prompt{quote}); or add a header row naming the text and expert columns")
            continue
        prompts.append(row[1].strip())
        labels.append(row[0].strip() or None)
    if problems:
        raise ConfigError(*problems[:10], *([f"--labeled {path}: {len(problems) - 10} more such rows"]
                                            if len(problems) > 10 else []))
    if not prompts:
        raise ConfigError(f"--labeled {path}: holds no prompt; write {shape} rows, or a header row and records")
    return prompts, labels


def _labeled_list(path: Path, content: str) -> tuple[list[str], list[Optional[str]]]:
    """A JSON list of records with "text"/"prompt" and "expert"/"label" (what a JSONL file holds, as one list)."""
    rows = json_document(path, content, "--labeled ")
    if not isinstance(rows, list) or not rows:
        raise ConfigError(f"--labeled {path}: expected a JSON list of records with \"text\" and \"expert\" fields")
    prompts, labels, problems = [], [], []
    for i, row in enumerate(rows):
        text = row.get("text", row.get("prompt")) if isinstance(row, dict) else None
        label = row.get("expert", row.get("label")) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            problems.append(f"--labeled {path}: item {i}: no prompt text (a record needs a \"text\" or \"prompt\" field)")
            continue
        prompts.append(text.strip())
        labels.append(label.strip() if isinstance(label, str) and label.strip() else None)
    if problems:
        raise ConfigError(*problems)
    return prompts, labels
