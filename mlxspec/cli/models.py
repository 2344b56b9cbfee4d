"""`mlxspec models`: what the cache holds (named models, conversions, drafts, policies, wheels),
fetching a named model ahead of time, and removing one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click

from .common import exits_cleanly

KINDS = {  # kind -> the heading of its section, in the order they are listed
    "named": "named models (-m NAME)",
    "conversion": "converted GGUF folders (gguf/)",
    "draft": "trained drafts (drafts/)",
    "policy": "policy files (policy/)",
    "wheel": "wheels (wheels/)",
    "partial": "unfinished files (from an interrupted fetch or conversion)",
    "other": "other",
}


def _size(path: Path) -> int:
    """Bytes under `path` (a file or a folder; links not followed)."""
    try:
        if path.is_symlink() or path.is_file():
            return path.lstat().st_size
        return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() or p.is_symlink())
    except OSError:
        return 0


def human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _same(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def cache_entries() -> tuple[Path, list[dict]]:
    """(the cache root, every entry in it): dicts with kind, name (its path under the cache, or
    the model's name), path, bytes, and what else is known of it."""
    from ..gguf.sources import NAMED_MODELS, cache_root, named_model_cached, named_model_path

    root = cache_root()
    entries: list[dict] = []
    seen: set[Path] = set()  # paths an entry accounts for

    def add(kind: str, path: Path, **extra) -> dict:
        entry = {"kind": kind, "name": str(path.relative_to(root)), "path": str(path),
                 "bytes": _size(path), **extra}
        entries.append(entry)
        seen.add(path)
        return entry

    # Named models: the GGUF file and its marker; anything else in its folder is unfinished.
    named_paths = {}
    for name, model in NAMED_MODELS.items():
        gguf = named_model_path(name)
        named_paths[name] = gguf
        ready = named_model_cached(name) is not None
        entries.append({
            "kind": "named", "name": name, "path": str(gguf), "fetched": ready,
            "bytes": _size(gguf) + _size(gguf.with_name(gguf.name + ".sha256")) if ready else 0,
            "description": model.description, "license": model.license,
            "download_bytes": model.wheel_bytes, "gguf_bytes": model.gguf_bytes or None,
            "float32_bytes": model.float32_bytes or None, "default_draft": model.default_draft,
            "fim": model.fim, "wheels": model.wheel_names()})
        seen.add(gguf.parent)
        folder = gguf.parent
        if folder.is_dir():
            for path in sorted(folder.iterdir()):
                if not ready or path not in (gguf, gguf.with_name(gguf.name + ".sha256")):
                    add("partial", path, model=name)
    # The Qwen2.5-Coder sizes: found in the Hugging Face cache or fetched from the Hub.
    from ..hub import CODER_MODELS, cached_sources, is_gpu
    from ..loading import default_draft

    for name, coder in CODER_MODELS.items():
        where = cached_sources(coder)
        entry = next((e for e in entries if e["kind"] == "named" and e["name"] == name), None)
        if entry is None:
            entry = {"kind": "named", "name": name, "path": "", "fetched": False, "bytes": 0,
                     "description": coder.description, "license": coder.license,
                     "download_bytes": coder.gguf_bytes, "gguf_bytes": coder.gguf_bytes or None,
                     "float32_bytes": None, "fim": True, "wheels": []}
            entries.append(entry)
        entry["default_draft"] = default_draft(name)
        entry["sources"] = [coder.mlx_repo, f"{coder.gguf_repo}/{coder.gguf_file}"] + (
            [f"chunk wheels ({NAMED_MODELS[coder.wheels].requirement})"] if coder.wheels else [])
        entry["fetch_command"] = coder.hf_command(is_gpu())
        if where and not entry["fetched"]:
            what, path = where[0]
            entry.update(fetched=True, path=str(path), found_in=what,
                         bytes=_size(path) if path.is_file() else sum(
                             _size(f) for f in path.glob("*.safetensors")))

    # Conversions: gguf/<sha24>-<weights>-v<N>/, source.json naming the file; gguf/*.tmpPID
    # are unfinished ones.
    pinned = {m.sha256[:24]: n for n, m in NAMED_MODELS.items() if m.chunks}
    gguf_dir = root / "gguf"
    seen.add(gguf_dir)
    if gguf_dir.is_dir():
        for path in sorted(gguf_dir.iterdir()):
            if path.name == "hashes.json":  # the remembered SHA-256s of GGUF files: tiny
                seen.add(path)
                continue
            if ".tmp" in path.name:
                add("partial", path)
                continue
            if not path.is_dir():
                add("other", path)
                continue
            info = _read_json(path / "source.json")
            source = info.get("source")
            model = pinned.get(path.name.split("-", 1)[0])
            if model is None and source:
                model = next((n for n, p in named_paths.items() if _same(p, source)), None)
            add("conversion", path, source=source, weights=info.get("weights"), model=model)

    # Trained drafts: drafts/<key>/ (the key is the model's name for a named model).
    drafts = root / "drafts"
    seen.add(drafts)
    if drafts.is_dir():
        from ..reduced_draft import is_reduced_draft

        for path in sorted(drafts.iterdir()):
            if is_reduced_draft(path):
                add("draft", path, model=path.name if path.name in NAMED_MODELS else None)
            else:
                add("partial" if ".tmp" in path.name else "other", path)

    policy = root / "policy"
    seen.add(policy)
    if policy.is_dir():
        for path in sorted(policy.iterdir()):
            add("policy" if path.suffix == ".json" else "other", path)

    wheels = root / "wheels"
    seen.add(wheels)
    owners = {w: n for n, m in NAMED_MODELS.items() for w in m.wheel_names()}
    if wheels.is_dir():
        for path in sorted(wheels.iterdir()):
            add("wheel" if path.suffix == ".whl" else "partial", path,
                model=owners.get(path.name))

    models_dir = root / "models"
    seen.add(models_dir)
    if models_dir.is_dir():  # folders of names no longer known
        for path in sorted(models_dir.iterdir()):
            if path not in seen:
                add("other", path)
    seen.add(root / "model_info.json")  # the remembered shapes and tokenizers: tiny
    for path in sorted(root.iterdir()):
        if path not in seen and path.suffix != ".lock":
            add("other", path)
    order = list(KINDS)
    entries.sort(key=lambda e: order.index(e["kind"]))
    return root, entries


STORES = {  # store -> the heading of its section
    "huggingface": "Hugging Face cache (-m REPO, or REPO:FILE for one GGUF file of a repo)",
    "lmstudio": "LM Studio (-m lmstudio:PUBLISHER/REPO)",
    "ollama": "Ollama (-m ollama:NAME:TAG)",
}


def store_entries() -> list[dict]:
    """The models of the Hugging Face cache and of LM Studio's and Ollama's stores (read,
    never changed): dicts with store, name (what -m takes), kind, path, bytes, note."""
    from ..hub import hf_cache_dir, lmstudio_root, stored_models

    roots = {"huggingface": str(hf_cache_dir()), "lmstudio": str(lmstudio_root() or ""),
             "ollama": ""}
    out = []
    for m in stored_models():
        out.append({"store": m.store, "name": m.name, "kind": m.kind, "path": str(m.path),
                    "bytes": m.bytes, "note": m.note, "root": roots.get(m.store, "")})
    return out


def _print_stores(stores: list[dict]) -> None:
    for store, heading in STORES.items():
        group = [e for e in stores if e["store"] == store]
        if not group:
            continue
        click.echo(f"\n{heading}:")
        width = max(len(e["name"]) for e in group)
        for e in group:
            note = f"  ({e['kind']}{', ' + e['note'] if e['note'] else ''})"
            click.echo(f"  {e['name']:<{width}}  {human(e['bytes']):>8}{note}")


def _print_list(root: Path, entries: list[dict], stores: list[dict] | None = None) -> None:
    total = sum(e["bytes"] for e in entries)
    click.echo(f"cache: {root} ({human(total)} in all; $MLXSPEC_CACHE moves it)")
    for kind, heading in KINDS.items():
        group = [e for e in entries if e["kind"] == kind]
        if not group and kind not in ("named", "conversion"):
            continue
        click.echo(f"\n{heading}:")
        if not group:
            click.echo("  (none)")
        width = max((len(e["name"]) for e in group), default=0)
        for e in group:
            if kind == "named":
                if e["fetched"]:
                    state = e["path"]
                elif e["download_bytes"]:
                    state = (f"not fetched ({human(e['download_bytes'])} to download: "
                             f"`mlxspec models fetch {e['name']}`)")
                else:
                    state = (f"not fetched (`mlxspec models fetch {e['name']}`, or "
                             f"`{e.get('fetch_command')}`)")
                draft = f", draft {e['default_draft']}" if e["default_draft"] else ""
                click.echo(f"  {e['name']:<{width}}  {human(e['bytes']) if e['bytes'] else '-':>8}"
                           f"  {state}")
                click.echo(f"  {'':<{width}}  {'':>8}  {e['description']}, {e['license']}"
                           f"{draft}")
                continue
            notes = []
            if e.get("model"):
                notes.append(f"of {e['model']}")
            if e.get("weights"):
                notes.append(e["weights"])
            if kind == "conversion" and e.get("source") and not e.get("model"):
                notes.append(f"from {e['source']}")
            note = f"  ({', '.join(notes)})" if notes else ""
            click.echo(f"  {e['name']:<{width}}  {human(e['bytes']):>8}{note}")
    _print_stores(stores or [])
    click.echo("\n`mlxspec models rm NAME|PATH` removes one (PATH as listed, under the cache; "
               "the other stores are only read).")


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the table.")
@click.pass_context
def models(ctx, as_json: bool):
    """What the cache holds, fetching a named model ahead of time, removing one.

    Alone (or `models list`): the named models (`-m NAME`: fetched or not, sizes, paths), the
    converted GGUF folders, trained drafts, policy files, wheels and unfinished files in the
    cache ($MLXSPEC_CACHE, else ~/.cache/mlxspec), with their sizes; then the models already in
    the Hugging Face cache, LM Studio's and Ollama's stores, each by the name -m takes.
    """
    if ctx.invoked_subcommand is None:
        ctx.invoke(list_, as_json=as_json)


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the table.")
@exits_cleanly
def list_(as_json: bool):
    """List what the cache holds, with sizes and paths."""
    root, entries = cache_entries()
    stores = store_entries()
    if as_json:
        click.echo(json.dumps({"cache": str(root), "bytes": sum(e["bytes"] for e in entries),
                               "entries": entries, "stores": stores}, indent=2))
    else:
        _print_list(root, entries, stores)


@models.command()
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option("--no-draft", is_flag=True,
              help="Do not also fetch the model's default draft (qwen2.5-coder-1.5b's is "
                   "qwen2.5-coder-0.5b).")
@exits_cleanly
def fetch(names: tuple[str, ...], no_draft: bool):
    """Fetch named models now (for a later offline run); prints each one's path.

    A Qwen2.5-Coder size comes from the Hugging Face cache, else the Hub (MLX 4-bit on Metal,
    the official GGUF on the CPU), else its chunk wheels. Progress goes to stderr. A model with
    a default draft fetches that too, unless --no-draft.
    """
    from ..errors import MlxspecError
    from ..gguf.sources import NAMED_MODELS, named_model_gguf
    from ..hub import CODER_MODELS, resolve_coder
    from ..loading import default_draft

    known = sorted(set(NAMED_MODELS) | set(CODER_MODELS))
    wanted: list[str] = []
    for name in names:
        if name not in known:
            raise MlxspecError(f"unknown model name {name!r}; known: {', '.join(known)}")
        draft = default_draft(name)
        for n in (name, None if no_draft else draft):
            if n and n not in wanted:
                wanted.append(n)
    for name in wanted:
        path = resolve_coder(name) if name in CODER_MODELS else named_model_gguf(name)
        click.echo(f"{name}\t{path}")


def _remove(path: Path) -> int:
    size = _size(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    return size


@models.command()
@click.argument("target", metavar="NAME|PATH")
@exits_cleanly
def rm(target: str):
    """Remove a named model (its GGUF file, its conversions and its wheels) or one entry of the
    cache (PATH as `mlxspec models` lists it, or its full path). Asks nothing; prints what was
    removed and the bytes freed. A trained draft for the model is kept (remove it by its path).
    """
    from ..errors import MlxspecError
    from ..gguf.sources import NAMED_MODELS, named_model_lock

    root, entries = cache_entries()
    named = next((e for e in entries if e["kind"] == "named"
                  and (e["name"] == target or _same(e["path"], target))), None)
    if named is not None:
        name = named["name"]
        with named_model_lock(name):
            paths = [Path(named["path"]).parent]
            paths += [Path(e["path"]) for e in entries
                      if e["kind"] in ("conversion", "wheel", "partial") and e.get("model") == name]
            paths = [p for p in paths if p.exists() or p.is_symlink()]
            if not paths:
                click.echo(f"nothing of {name} in the cache ({root})")
                return
            freed = 0
            for path in paths:
                size = _remove(path)
                freed += size
                click.echo(f"removed {path} ({human(size)})")
        click.echo(f"freed {freed} bytes ({human(freed)})")
        return
    entry = next((e for e in entries if e["kind"] != "named"
                  and (e["name"] == target or _same(e["path"], target))), None)
    if entry is None:
        raise MlxspecError(f"no named model or cache entry {target!r} (named models: "
                           f"{', '.join(sorted(NAMED_MODELS))}; `mlxspec models` lists the "
                           f"entries of {root})")
    path = Path(entry["path"])
    size = _remove(path)
    click.echo(f"removed {path} ({human(size)})")
    click.echo(f"freed {size} bytes ({human(size)})")
