"""mergekit's ``model+adapter`` references: a PEFT LoRA adapter merged into a model as it is read.

A reference ``X+Y`` (each a folder or a hub id in the local cache, optionally ``@revision``) reads
as model X with the LoRA adapter Y merged in, exactly as peft's ``merge_and_unload()`` computes it:
``W' = W + scaling * (B @ A)`` in float32, cast back to W's dtype, with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``) and per-module ``rank_pattern`` / ``alpha_pattern``.
An embedding's delta is ``(B @ A).T * scaling`` (peft's ``lora_embedding_A/B``). Whole tensors the
adapter saved (``modules_to_save`` copies, trained biases, peft's saved embedding ``base_layer``)
replace the model's before the merge. As peft does for ``nn.Linear`` layers (every layer this tool
reads), ``fan_in_fan_out`` is not applied.

`Adapter.open` reads adapter_config.json and the adapter's tensor headers and checks every key
against the model; `Checkpoint.read` merges one tensor at a time (the adapter's two small
matrices for it, read when needed). `merge_into_model` does the same to a model loaded whole by
transformers (gate capture, verify's dense reference). It does not download anything.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open

from moe_upcycle.errors import SourceError, UpcycleWarning
from moe_upcycle.checkpoint.bin_files import load_bin
from moe_upcycle.checkpoint.file_stamp import FileStamp
from moe_upcycle.checkpoint.headers import read_safetensors_header
from moe_upcycle.checkpoint.model_refs import resolve_model

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# base_model.model.<module>.lora_A[.default].weight (older peft keeps the adapter name)
# embeddings' A and B are parameters of their own: base_model.model.<module>.lora_embedding_A[.default]
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?:(?P<part>lora_A|lora_B)(?:\.[A-Za-z0-9_]+)?\.weight"
                  r"|(?P<emb>lora_embedding_A|lora_embedding_B)(?:\.[A-Za-z0-9_]+)?)$")
# whole tensors loaded in place of the model's before the merge: peft's save_embedding_layers
# (<module>.base_layer.weight), a trained bias (bias: all / lora_only; <module>[.base_layer].bias) and
# modules_to_save (<module>.weight, <module>.bias: peft saves the trained copy under the module's own name)
# (older peft: <module>.modules_to_save[.<adapter name>].weight)
_WHOLE = re.compile(r"^base_model\.model\.(?P<module>.+?)(?P<wrap>\.base_layer|\.modules_to_save(?:\.[A-Za-z0-9_]+)?)?"
                    r"\.(?P<param>weight|bias)$")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def split_ref(ref: str) -> tuple[str, Optional[str]]:
    """``X+Y`` as (X, Y); a plain reference (or an existing folder whose name holds '+') as (ref, None)."""
    if "+" not in ref or Path(os.path.expanduser(ref)).is_dir():
        return ref, None
    model, _, adapter = ref.partition("+")
    return model, adapter


def reference_parts(ref: str, field_name: str) -> tuple[str, Optional[str]]:
    """`split_ref`, refusing an empty model or adapter part (``X+`` or ``+Y`` would read the current folder).

    Raises:
        SourceError: a part is empty.
    """
    model, adapter = split_ref(ref)
    if adapter is not None and (not model.strip() or not adapter.strip()):
        raise SourceError(f"{field_name}: {ref!r} has an empty {'model' if not model.strip() else 'adapter'} part; "
                          f"mergekit's model+LoRA form is MODEL+ADAPTER, each a folder or hub id")
    if adapter is not None and "+" in adapter and not Path(os.path.expanduser(adapter)).is_dir():
        from moe_upcycle.terminal.hints import missing_model_hint

        raise SourceError(f"{field_name}: {missing_model_hint(ref)}")  # "names more than one '+'", and the fix
    return model, adapter


@dataclass
class LoraPair:
    """One adapted weight: its A (r, in) and B (out, r) keys, scaling, and whether it is an embedding."""

    a_key: str
    b_key: str
    scaling: float
    embedding: bool


@dataclass
class Adapter:
    """A LoRA adapter checked against one model's tensors.

    Attributes:
        ref: the adapter reference as written; path: its folder; file: its weights file.
        pairs: model weight key -> the LoRA pair that changes it.
        replaced: model weight key -> the adapter tensor that replaces it before the merge (peft's
            ``save_embedding_layers``: ``<module>.base_layer.weight``).
        dtypes: model weight key -> the model's stored dtype (the merged tensor's dtype).
        base_name: adapter_config.json's base_model_name_or_path.
    """

    ref: str
    path: Path
    file: Path
    pairs: dict[str, LoraPair]
    dtypes: dict[str, torch.dtype]
    base_name: str = ""
    replaced: dict[str, str] = field(default_factory=dict)
    stamp: Optional[FileStamp] = None  # the adapter file as its header was read (see `file_stamp`)
    _state: Optional[dict] = field(default=None, repr=False)

    @classmethod
    def open(cls, ref: str, field_name: str, model_tensors: dict, model_ref: str) -> "Adapter":
        """Read and check adapter `ref` against a model's tensor headers (key -> TensorInfo).

        Raises:
            SourceError: every problem found, each naming the adapter file, key or field and the fix.
        """
        path = resolve_adapter(ref, field_name)
        where = f"{field_name}: LoRA adapter {ref!r}"
        cfg_file = path / "adapter_config.json"
        if not cfg_file.is_file():
            raise SourceError(f"{where}: {path} has no adapter_config.json; give the folder a PEFT adapter was saved "
                              f"to (save_pretrained writes adapter_config.json and adapter_model.safetensors)")
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (ValueError, OSError, RecursionError) as exc:
            raise SourceError(f"{cfg_file}: not valid JSON ({exc}); save the adapter again") from None
        if not isinstance(cfg, dict):
            raise SourceError(f"{cfg_file}: expected a JSON object")
        problems = _config_problems(cfg, cfg_file)
        if problems:
            raise SourceError(*problems)
        file = next((path / f for f in ADAPTER_FILES if (path / f).is_file()), None)
        if file is None:
            raise SourceError(f"{where}: {path} has no {' or '.join(ADAPTER_FILES)}; save the adapter with peft's "
                              f"save_pretrained")
        stamp = FileStamp.of(os.stat(file))
        infos = ({k: (i.shape, i.dtype) for k, i in read_safetensors_header(file).items()}
                 if file.suffix == ".safetensors" else {k: (tuple(t.shape), t.dtype) for k, t in load_bin(file).items()})
        replaced, problems = _replacements(infos, file, model_tensors, model_ref)
        pairs, more = _pair_up({k: v for k, v in infos.items() if not _is_whole(k)}, cfg, file,
                               model_tensors, model_ref)
        problems += more
        if not pairs and not replaced and not problems:
            problems.append(f"{file}: holds no LoRA weights (base_model.model.<module>.lora_A.weight); is this a "
                            f"PEFT LoRA adapter?")
        if problems:
            raise SourceError(*problems)
        base_name = str(cfg.get("base_model_name_or_path") or "")
        if base_name and not _same_model(base_name, model_ref):
            warnings.warn(f"{field_name}: LoRA adapter {ref!r} was trained on {base_name!r} (adapter_config.json "
                          f"base_model_name_or_path), not {model_ref!r}; it is merged anyway, as mergekit does",
                          UpcycleWarning, stacklevel=2)
        dtypes = {k: model_tensors[k].dtype for k in [*pairs, *replaced]}
        return cls(ref=ref, path=path, file=file, pairs=pairs, dtypes=dtypes, base_name=base_name, replaced=replaced,
                   stamp=stamp)

    def changes(self, key: str) -> bool:
        """Whether this adapter changes model weight `key`."""
        return key in self.pairs or key in self.replaced

    def check_unchanged(self) -> None:
        """Raise `SourceError` when the adapter file changed since its header was read."""
        if self.stamp is not None:
            self.stamp.check(self.file)

    def _tensor(self, key: str) -> torch.Tensor:
        self.check_unchanged()
        if self.file.suffix == ".safetensors":
            with safe_open(str(self.file), framework="pt", device="cpu") as fh:
                return fh.get_tensor(key)
        if self._state is None:
            self._state = load_bin(self.file)
        return self._state[key]

    def delta(self, key: str) -> torch.Tensor:
        """scaling * (B @ A) for model weight `key` in float32 (transposed for an embedding)."""
        pair = self.pairs[key]
        a, b = self._tensor(pair.a_key).float(), self._tensor(pair.b_key).float()
        delta = (b @ a).mul_(pair.scaling)  # (out, in), or (dim, vocab) for an embedding
        return delta.T if pair.embedding else delta

    def merge(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` (the model's `key`) with this adapter merged: fp32 sum, cast to `weight`'s dtype."""
        if key in self.replaced:
            weight = self._tensor(self.replaced[key]).to(device=weight.device, dtype=weight.dtype)
        if key not in self.pairs:
            return weight
        # never in place: `weight` may be a view of the mapped input file
        return (weight.float() + self.delta(key).to(weight.device)).to(weight.dtype)


def resolve_adapter(ref: str, field_name: str) -> Path:
    """The folder of adapter `ref` (a folder or a cached hub id, optionally @revision).

    Raises:
        SourceError: not found; says where it looked and how to get it.
    """
    try:
        return resolve_model(ref, f"{field_name} (LoRA adapter)")
    except SourceError as exc:
        raise SourceError(*[_adapter_hint(p, ref) for p in exc.problems]) from None


def _adapter_hint(problem: str, ref: str) -> str:
    """`resolve_model`'s message for a missing adapter, with the advice an adapter needs (not a model's)."""
    from moe_upcycle.terminal.hints import download_command, is_hub_id

    repo, _, revision = ref.partition("@")
    if " not found " not in problem or not is_hub_id(repo):
        return problem
    head = problem.split("; ")[0]
    return (f"{head}; give the adapter's folder, or download it first "
            f"({download_command(repo, *(('--revision', revision) if revision else ()))})")


def _config_problems(cfg: dict, cfg_file: Path) -> list[str]:
    problems = []
    for name in ("use_dora", "use_rslora", "fan_in_fan_out"):  # "false" as text would read as true
        if cfg.get(name) is not None and not isinstance(cfg.get(name), bool):
            problems.append(f"{cfg_file}: {name} must be true or false, got {cfg.get(name)!r}; save the adapter again "
                            f"(or write \"{name}\": {str(str(cfg.get(name)).strip().lower() in ('true', '1', 'yes')).lower()})")
    if problems:
        return problems
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        problems.append(f"{cfg_file}: peft_type is {kind!r}; only LORA adapters can be merged — merge this "
                        f"adapter with peft (merge_and_unload) and give the merged folder")
    if cfg.get("use_dora"):
        problems.append(f"{cfg_file}: use_dora is true; DoRA adapters are not merged by moe-upcycle — merge it with "
                        f"peft (merge_and_unload().save_pretrained(folder)) and give that folder")
    if cfg.get("layer_replication"):
        problems.append(f"{cfg_file}: layer_replication is set; an adapter that replicates layers changes the "
                        f"model's depth and cannot be merged here — merge it with peft and give the merged folder")
    for name in ("r", "lora_alpha"):
        value = cfg.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
            problems.append(f"{cfg_file}: {name} must be a positive number, got {value!r}")
    for name in ("rank_pattern", "alpha_pattern"):
        value = cfg.get(name) or {}
        if not isinstance(value, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  and 0 < v < math.inf for v in value.values()):
            problems.append(f"{cfg_file}: {name} must map module names to positive numbers, got {value!r}")
    return problems


def _replacements(infos: dict, file: Path, model: dict, model_ref: str) -> tuple[dict[str, str], list[str]]:
    """Whole tensors the adapter saved, loaded in place of the model's (see `_WHOLE`): model key -> adapter key."""
    replaced, problems = {}, []
    tied = _ties_head(model)
    for key, (shape, dtype) in infos.items():
        if not _is_whole(key):
            continue
        m = _WHOLE.match(key)
        target = f"{m['module']}.{m['param']}"
        if target in replaced:
            problems.append(f"{file}: tensors {replaced[target]!r} and {key!r} both replace {target!r}; keep one "
                            f"(save the adapter again)")
        elif tied and (target == "lm_head.weight" or (target.endswith("embed_tokens.weight") and m["wrap"] != ".base_layer")):
            problems.append(f"{file}: tensor {key!r} is a trained copy of {target.rsplit('.', 1)[0]!r} "
                            f"(modules_to_save), but model {model_ref!r} ties lm_head to its embedding; peft's merge "
                            f"unties them (one keeps the old weights), which a tied model cannot hold — merge it with "
                            f"peft (merge_and_unload().save_pretrained(folder)) and give that folder")
        elif target not in model and m["param"] == "bias" and f"{m['module']}.weight" in model:
            problems.append(f"{file}: tensor {key!r} is a bias for {m['module']!r}, which has no bias in model "
                            f"{model_ref!r} (adapter_config.json bias / lora_bias); an MoE of this family has no "
                            f"place for it — train the adapter with bias: none")
        elif target not in model:
            problems.append(f"{file}: tensor {key!r} replaces {target!r}, which model {model_ref!r} does not have; "
                            f"is this adapter for another model?")
        elif tuple(shape) != tuple(model[target].shape):
            problems.append(f"{file}: tensor {key!r} is {list(shape)} but {target!r} of {model_ref!r} is "
                            f"{list(model[target].shape)} (a resized vocabulary?); resize the model's embeddings "
                            f"as in training and merge with peft, then give that folder")
        elif dtype not in _FLOATS:
            problems.append(f"{file}: {key!r} is {dtype}; save the adapter in a floating-point dtype")
        else:
            replaced[target] = key
    return replaced, problems


def _ties_head(model: dict) -> bool:
    """Whether the model's lm_head is its embedding (no lm_head tensor of its own)."""
    return "lm_head.weight" not in model and any(k.endswith("embed_tokens.weight") for k in model)


def _is_whole(key: str) -> bool:
    """Whether adapter tensor `key` is a whole tensor to load in place of the model's (not a LoRA matrix)."""
    return _WHOLE.match(key) is not None and ".lora_" not in key


def _pattern(patterns: dict, module: str, default: float) -> float:
    """peft's per-module override: a pattern matching the module name's end (regex), else `default`."""
    for key, value in patterns.items():
        if key == module or re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _pair_up(infos: dict, cfg: dict, file: Path, model: dict, model_ref: str) -> tuple[dict[str, LoraPair], list[str]]:
    found: dict[str, dict[str, str]] = {}
    problems = []
    for key in infos:
        m = _KEY.match(key)
        if m is None:
            if key.endswith(".bias"):  # lora_B's own bias (lora_bias: true)
                problems.append(f"{file}: tensor {key!r}: adapters with lora_bias are not merged by moe-upcycle; "
                                f"merge it with peft (merge_and_unload().save_pretrained(folder)) and give that folder")
            elif ".token_adapter." in key or "trainable_tokens" in key:  # trainable_token_indices: trained token rows
                problems.append(f"{file}: tensor {key!r}: adapters with trainable tokens (trainable_token_indices) "
                                f"are not merged by moe-upcycle; merge it with peft "
                                f"(merge_and_unload().save_pretrained(folder)) and give that folder")
            else:
                problems.append(f"{file}: tensor {key!r} is not a LoRA weight (base_model.model.<module>.lora_A.weight "
                                f"or lora_B); is this a PEFT LoRA adapter?")
            continue
        parts = found.setdefault(m["module"], {})
        part = m["part"] or m["emb"]
        if part in parts:  # e.g. lora_A.weight beside lora_A.default.weight: which one peft loads is unclear
            problems.append(f"{file}: tensors {parts[part]!r} and {key!r} are both {part} of {m['module']!r}; "
                            f"keep one (save the adapter again)")
            continue
        parts[part] = key
    pairs = {}
    for module, parts in found.items():
        embedding = "lora_embedding_A" in parts or "lora_embedding_B" in parts
        a_key = parts.get("lora_embedding_A" if embedding else "lora_A")
        b_key = parts.get("lora_embedding_B" if embedding else "lora_B")
        if a_key is None or b_key is None:
            problems.append(f"{file}: module {module!r} has {' and '.join(parts.values())} but not its "
                            f"{'B' if a_key else 'A'} matrix; the adapter file is incomplete — save it again")
            continue
        target = f"{module}.weight"
        if target not in model and module.endswith("lm_head") and _ties_head(model):
            problems.append(f"{file}: tensor {a_key!r} adapts {target!r}, but model {model_ref!r} ties lm_head to its "
                            f"embedding (no lm_head tensor of its own), so merging it would change the embedding "
                            f"too, which moe-upcycle does not do; merge this adapter with peft "
                            f"(merge_and_unload().save_pretrained(folder)) and give that folder")
            continue
        if target not in model:
            problems.append(f"{file}: tensor {a_key!r} adapts {target!r}, which model {model_ref!r} does not have; "
                            f"is this adapter for another model?")
            continue
        (sa, da), (sb, db) = infos[a_key], infos[b_key]
        bad = [f"{k!r} is {d}" for k, d in ((a_key, da), (b_key, db)) if d not in _FLOATS]
        if bad:
            problems.append(f"{file}: {', '.join(bad)}; LoRA weights must be floating point (a quantized adapter "
                            f"cannot be merged) — save the adapter in float32, float16 or bfloat16")
            continue
        if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[1]:
            problems.append(f"{file}: {a_key!r} is {list(sa)} and {b_key!r} is {list(sb)}: their ranks differ "
                            f"(A must be (r, in), B (out, r)); the adapter file is damaged — save it again")
            continue
        wshape = tuple(model[target].shape)
        out_in = (sa[1], sb[0]) if embedding else (sb[0], sa[1])
        if len(wshape) != 2 or out_in != wshape:
            problems.append(f"{file}: {a_key!r} {list(sa)} and {b_key!r} {list(sb)} make a {list(out_in)} change "
                            f"but {target!r} of {model_ref!r} is {list(wshape)}; is this adapter for another model?")
            continue
        r = _pattern(cfg.get("rank_pattern") or {}, module, cfg["r"])
        alpha = _pattern(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
        if sa[0] != r:
            problems.append(f"{file}: {a_key!r} has rank {sa[0]} but adapter_config.json gives r = {r} for {module!r} "
                            f"(r / rank_pattern); the config does not match the weights — save the adapter again")
            continue
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        pairs[target] = LoraPair(a_key, b_key, scaling, embedding)
    return pairs, problems


def _same_model(name: str, model_ref: str) -> bool:
    """False only when adapter_config's base model and `model_ref` are both hub ids, and different ones
    (a local folder may hold any model: its name proves nothing)."""
    from moe_upcycle.terminal.hints import is_hub_id

    a, b = name.strip().rstrip("/"), model_ref.partition("@")[0]
    if Path(os.path.expanduser(model_ref)).is_dir() or not is_hub_id(a) or not is_hub_id(b) or Path(a).exists():
        return True
    return a.lower() == b.lower()


def merge_into_model(model: Any, adapter: Optional[Adapter]) -> None:
    """Merge `adapter` into a model loaded whole by transformers, in place (like peft's merge_and_unload).

    Each adapted weight is merged at the model's stored dtype (as `Checkpoint.read` returns it),
    then cast to the loaded dtype, so a forward pass sees the weights the built MoE holds.

    Raises:
        SourceError: the loaded model has no parameter of that name, or it is quantized.
    """
    if adapter is None:
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in [*adapter.pairs, *(k for k in adapter.replaced if k not in adapter.pairs)]:
            param = params.get(key)
            if param is None:
                raise SourceError(f"LoRA adapter {adapter.ref!r}: the loaded model has no parameter {key!r} to merge "
                                  f"into")
            if param.device.type == "meta":  # accelerate offloaded it (device_map beyond the GPUs)
                raise SourceError(f"LoRA adapter {adapter.ref!r}: {key!r} was offloaded while loading the model whole, "
                                  f"and a LoRA cannot be merged into an offloaded weight; use device: cpu, or a GPU "
                                  f"the model fits on")
            if param.dtype not in _FLOATS:
                raise SourceError(f"LoRA adapter {adapter.ref!r}: {key!r} is loaded quantized ({param.dtype}); a LoRA "
                                  f"cannot be merged into it — remove quantize:")
            stored = param.data.to(adapter.dtypes[key])
            param.data.copy_(adapter.merge(key, stored).to(param.dtype))
