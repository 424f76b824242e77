"""Write a recipe back with grown prompt sets (``moe-upcycle prompts grow``).

The YAML is edited as text through a ruamel.yaml round trip (`yaml_write.add_prompts`), so the
user's comments, quotes and layout stay; the result is validated before it replaces anything, and
it is written atomically.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Optional, Sequence, Union

import yaml

from moe_upcycle.checkpoint.output_file import write_file
from moe_upcycle.errors import OutputError, UpcycleWarning
from moe_upcycle.recipe.schema import load_config
from moe_upcycle.recipe.yaml_write import add_prompts


def grown_target(config_path: Union[str, Path], output: Union[str, Path, None] = None, in_place: bool = False,
                 force: bool = False, inputs: Sequence[Union[str, Path]] = ()) -> Path:
    """The file `write_grown_config` writes, checked before any work is done.

    Raises:
        OutputError: the output is the input without `in_place`, a folder, in a missing folder,
            exists without `force`, or is one of `inputs`.
    """
    src = Path(config_path)
    if in_place:
        if output is not None and Path(output).resolve() != src.resolve():
            raise OutputError(f"-o {output}: --in-place writes {src}; give one of -o and --in-place")
        return src.resolve() if src.is_symlink() else src  # a link to the recipe: the recipe changes, the link stays
    if output is not None and str(output) == "-":
        raise OutputError("-o -: the grown recipe is written to a file, not to standard output; give a file name "
                          "(./- for a file named '-')")
    target = Path(output) if output is not None else src.with_name(f"{src.stem}.grown.yaml")
    if target.resolve() == src.resolve():
        raise OutputError(f"-o {target}: that is the input config; it is never overwritten unless you pass "
                          f"--in-place (or choose another -o)")
    if target.is_dir():  # never replaced, --force or not: it is not a file this command wrote
        raise OutputError(f"-o {target}: is a folder; give the path of the YAML file to write")
    if not target.parent.is_dir():
        raise OutputError(f"-o {target}: folder {target.parent} does not exist; create it or choose another -o")
    if target.exists() and not force:
        raise OutputError(f"-o {target}: file exists; pass --force to replace it or choose another -o")
    _refuse_inputs(target, inputs)  # the pool: read, never written (the config's prompt files: `write_grown_config`)
    return target


def _refuse_inputs(target: Path, inputs: Sequence[Union[str, Path]], folder: Optional[Path] = None) -> None:
    """Refuse writing over a file the command reads (a relative one: from here, or from `folder`)."""
    for item in inputs:
        places = {Path(os.path.expanduser(item)).resolve()}
        if folder is not None:
            places.add(Path(os.path.expanduser(folder / item)).resolve())
        if target.resolve() in places:
            raise OutputError(f"-o {target}: that is an input of this command ({item}); it is never overwritten, "
                              f"even with --force — choose another -o")


def write_grown_config(config_path: Union[str, Path], picks: dict[str, Sequence[str]], *,
                       output: Union[str, Path, None] = None, in_place: bool = False,
                       force: bool = False, allow_unknown_keys: bool = False,
                       inputs: Sequence[Union[str, Path]] = (), expected: Optional[bytes] = None) -> Path:
    """Write the config with the picks appended to each expert's `positive_prompts`.

    Args:
        config_path: the input YAML (read again, so keys the user wrote stay as written).
        picks: expert name -> prompts to append (the texts of `prompts.grow.grow_prompts`' picks).
        output: where to write; default ``<name>.grown.yaml`` beside the input.
        in_place: replace the input file (atomically). Without it the input is never written.
        force: replace an existing output file other than the input.
        allow_unknown_keys: accept keys moe-upcycle does not know (kept in the output as written).
        inputs: other files the command reads (the pool); like the config's own prompt files
            (``*_prompts_from``), they are never written, even with `force`.
        expected: the config's bytes when the picks were chosen; if it now holds others (a second
            ``prompts grow --in-place`` finished first, an editor saved it), nothing is written.

    Returns:
        The path written.

    Raises:
        OutputError: see `grown_target`; or the output is one of the config's prompt files, or cannot be written.
    """
    src = Path(config_path)
    target = grown_target(src, output, in_place, force, inputs)
    raw = src.read_bytes()
    if expected is not None and raw != expected:  # picks for one version, appended to another: twice, or stale
        raise OutputError(f"{src}: changed while the prompts were chosen (another prompts grow, or an editor saved "
                          f"it); nothing was written — run the command again on the recipe as it is now")
    original = raw.decode("utf-8-sig").replace("\r\n", "\n")
    # written back with the input's byte-order mark and line endings (a recipe saved on Windows stays CRLF)
    encoding, newline = ("utf-8-sig" if raw.startswith(b"\xef\xbb\xbf") else "utf-8"), ("\r\n" if b"\r\n" in raw else "\n")
    data = yaml.safe_load(original)
    with warnings.catch_warnings():  # the command already warned about unknown keys, once
        warnings.simplefilter("ignore", UpcycleWarning)
        config = load_config(dict(data), allow_unknown_keys=allow_unknown_keys)
    if not in_place:
        prompt_files = [getattr(e, f"{kind}_prompts_from", None) for e in config.expert_list() + list(config.shared_experts)
                        for kind in ("positive", "negative")]
        _refuse_inputs(target, [f for f in prompt_files if isinstance(f, str)], src.parent)
    added = {i: list(picks.get(expert.name, []))
             for i, expert in enumerate(config.expert_list()[:len(data.get("experts") or [])])}
    text = add_prompts(original, added)  # comments and layout kept
    grown = _read_back(text, data, added, target)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UpcycleWarning)
        load_config(dict(grown), allow_unknown_keys=allow_unknown_keys)  # still a valid config
    try:
        write_file(target, lambda tmp: tmp.write_text(text, encoding=encoding, newline=newline),
                   replace=in_place or force, mode_from=src)
    except FileExistsError:
        raise OutputError(f"-o {target}: file exists (it appeared while the prompts were chosen); pass --force to "
                          f"replace it or choose another -o") from None
    except OSError as exc:
        given = f"--in-place {target}" if in_place else f"-o {target}"
        raise OutputError(f"{given}: cannot write it ({exc.strerror or exc}); nothing was changed") from None
    return target


def _read_back(text: str, data: dict, added: dict[int, list[str]], target: Path) -> dict:
    """The grown recipe as the loader reads it, refused unless it is the user's recipe with only the new prompts
    appended, each exactly as picked (not a prompt turned into a boolean or a mapping, YAML that does not parse,
    or new prompts that also landed elsewhere through an alias).

    Raises:
        OutputError: what differs; nothing is written.
    """
    def plain(value):  # aliases become copies, so each list is compared where it is used
        return json.loads(json.dumps(value, default=str))

    try:
        grown = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise OutputError(f"-o {target}: the grown recipe would not read back as YAML ({str(exc).splitlines()[0]}); "
                          f"nothing was written — please report this with the prompts") from None
    expected = plain(data)
    for i, extra in added.items():
        if extra:
            expert = expected["experts"][i]
            before = expert.get("positive_prompts") or []
            expert["positive_prompts"] = ([before] if isinstance(before, str) else before) + list(extra)
    if plain(grown) != expected:
        raise OutputError(f"-o {target}: the grown recipe would not read back as the recipe plus the new prompts "
                          f"(an alias, or a prompt YAML reads as something else); nothing was written — please report "
                          f"this with the recipe")
    return grown
