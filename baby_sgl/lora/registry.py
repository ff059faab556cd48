"""The adapters clients may name, as SGLang's LoRA registry in its tokenizer manager: filled by
--lora-paths and /load_lora_adapter, emptied by /unload_lora_adapter. A request's lora_path is
checked here before it reaches the scheduler (an unknown name is the client's error) and becomes
the adapter's id: unique to each load (as SGLang's lora_id), so an adapter loaded again under
its name, maybe from other files, never finds the KV its predecessor computed in the radix
cache. An adapter being unloaded is no longer given out, so its requests run out."""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass

from baby_sgl.lora.adapter import LoRAError


@dataclass(frozen=True)
class LoRARef:
    """An adapter's name, where its files are, and whether it keeps its batch slot (pinned)."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str = ""  # given by the registry at load: the name and the load's number


def parse_lora_path(item: str | dict) -> LoRARef:
    """One --lora-paths entry: PATH (named after itself), NAME=PATH, or the JSON (or dict) form
    {"lora_name": ..., "lora_path": ..., "pinned": ...}."""
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-paths: {item!r} is not valid JSON: {e}") from None
    if isinstance(item, dict):
        unknown = set(item) - {"lora_name", "lora_path", "pinned"}
        if unknown or not isinstance(item.get("lora_name"), str) or not isinstance(item.get("lora_path"), str):
            raise ValueError(f"--lora-paths: {item!r} needs lora_name and lora_path (and optionally pinned), only")
        return LoRARef(item["lora_name"], item["lora_path"], bool(item.get("pinned", False)))
    name, sep, path = item.partition("=")
    return LoRARef(name, path) if sep else LoRARef(item, item)


class LoRARegistry:
    """Thread-safe: the server's handlers and the engine's callers share it."""

    def __init__(self, max_loaded_loras: int | None) -> None:
        self.max_loaded_loras = max_loaded_loras
        self._lock = threading.Lock()
        self._refs: dict[str, LoRARef] = {}
        self._loading: set[str] = set()
        self._loads = itertools.count(1)

    def begin_load(self, ref: LoRARef) -> LoRARef:
        """Reserves the name for an adapter being loaded (not given out until finish_load);
        returns the ref with its id."""
        with self._lock:
            if not ref.lora_name or ref.lora_name in self._refs or ref.lora_name in self._loading:
                raise LoRAError(f"LoRA adapter name {ref.lora_name!r} is empty or already loaded")
            if self.max_loaded_loras is not None and len(self._refs) + len(self._loading) >= self.max_loaded_loras:
                raise LoRAError(f"cannot load LoRA adapter {ref.lora_name!r}: --max-loaded-loras "
                                f"{self.max_loaded_loras} adapters are loaded; unload one first")
            self._loading.add(ref.lora_name)
            return LoRARef(ref.lora_name, ref.lora_path, ref.pinned, f"{ref.lora_name}#{next(self._loads)}")

    def finish_load(self, ref: LoRARef, ok: bool) -> None:
        with self._lock:
            self._loading.discard(ref.lora_name)
            if ok:
                self._refs[ref.lora_name] = ref

    def remove(self, name: str) -> LoRARef:
        """Stops giving the adapter out; its running requests finish."""
        with self._lock:
            if name not in self._refs:
                raise LoRAError(f"unknown LoRA adapter {name!r}")
            return self._refs.pop(name)

    def resolve(self, name: str) -> str:
        """The id of the adapter a request names (its lora_path, or the model's adapter part)."""
        with self._lock:
            if name not in self._refs:
                known = ", ".join(sorted(self._refs)) or "none"
                raise LoRAError(f"unknown LoRA adapter {name!r} (loaded: {known})")
            return self._refs[name].lora_id

    def refs(self) -> list[LoRARef]:
        with self._lock:
            return sorted(self._refs.values(), key=lambda r: r.lora_name)
