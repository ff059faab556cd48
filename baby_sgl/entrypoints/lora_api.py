"""SGLang's LoRA routes (/load_lora_adapter, /unload_lora_adapter), and the adapter a request's
`model` names on the OpenAI and Anthropic routes: "base:adapter", or an adapter's own name."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import FastAPI
from pydantic import Field

from baby_sgl.engine import Engine
from baby_sgl.validation import MAX_ID_LEN, Id, StrictModel, Text


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: Id
    lora_path: Annotated[Text, Field(min_length=1, max_length=4096)]
    pinned: bool = False


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: Annotated[Text, Field(min_length=1, max_length=MAX_ID_LEN)]


def adapter_of_model(engine: Engine, model: str | None) -> str | None:
    """The LoRA adapter a request's model names (None: the base model). With adapters served,
    "base:adapter" names one (an unknown one is refused by the engine) and so does an adapter's
    own name; any other name is the base model, as before."""
    if model is None or not engine.engine_args.enable_lora:
        return None
    if ":" in model:
        return model.rsplit(":", 1)[1]
    return model if model in {r.lora_name for r in engine.lora_adapters()} else None


def add_lora_routes(app: FastAPI) -> None:
    engine: Engine = app.state.engine

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> dict:
        return await asyncio.to_thread(engine.load_lora_adapter, body.lora_name, body.lora_path, body.pinned)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> dict:
        return await asyncio.to_thread(engine.unload_lora_adapter, body.lora_name)
