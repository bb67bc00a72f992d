"""The weights a trainer pushes into a rollout engine: its parameters under the base model's names.

A peft LoRA policy's adapter is merged out of place, layer by layer, as the engine consumes the
weights; adapter tensors themselves are not pushed.
"""

from __future__ import annotations

import contextlib
import re

import torch
from peft import PeftModel


def base_weight_name(name: str) -> str | None:
    """The base model's name of a (possibly peft-wrapped) parameter; None for adapter tensors.

    >>> base_weight_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight")
    'model.layers.0.self_attn.q_proj.weight'
    >>> base_weight_name("base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight")
    >>> base_weight_name("model.norm.weight")
    'model.norm.weight'
    """
    if ".lora_" in name or ".original_module." in name:
        # adapter tensors (merged into the base weight) / the copy modules_to_save replaced
        return None
    name = name.replace("_orig_mod.", "")  # a torch.compile'd model
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    return re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)


def is_peft_model(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)


@contextlib.contextmanager
def engine_weights(model: torch.nn.Module, dtype: torch.dtype | None = None):
    """The weights to push, an iterator of (base name, tensor), valid inside the ``with`` block,
    each in the engine's ``dtype`` (None: the parameter's own; float32 weights of a
    --full-finetune are cast one tensor at a time into a bf16 engine).

    For a peft model each LoRA layer's merged weight W + scale * B A is computed out of place in
    float32, one layer at a time as the engine consumes them, and cast to the engine's dtype: the
    trainer's base weights are never touched. (peft's merge_adapter / unmerge_adapter, TRL's
    route, adds and subtracts the delta in place; in bf16 W + d - d != W, so the base -- which is
    also the reference policy -- drifts by a rounding error per sync, and a delta below half an
    ulp never reaches the engine.) A full model gives its parameters as they are (cast, if the
    engine's dtype differs). No copy is kept: the engine copies each tensor into its own storage.
    Tied weights appear once.
    """
    lora_layers = {}
    if is_peft_model(model):
        for module_name, module in model.named_modules():
            if hasattr(module, "get_delta_weight") and hasattr(module, "lora_A"):
                lora_layers[f"{module_name}.base_layer.weight"] = module

    def weights():
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                base = base_weight_name(name)
                if base is None:
                    continue
                module = lora_layers.get(name)
                if module is None or module.disable_adapters:
                    yield base, parameter.detach().to(dtype or parameter.dtype)
                    continue
                merged = parameter.detach().float()
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        merged = merged + module.get_delta_weight(adapter).float()
                yield base, merged.to(dtype or parameter.dtype)

    yield weights()
