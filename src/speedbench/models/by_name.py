"""Models by name, for the one-line model configs (`timm: resnet18`, `torchvision:
mobilenet_v3_small`, `hf: BertForSequenceClassification`): each builder takes the name
positionally, so that no keyword of the library (timm's `model_name`) meets speedbench's.

Every model is built with random weights: nothing is downloaded. The libraries are imported
when a model is built, so speedbench needs none of them installed.
"""
from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

# Special-token ids of a Hugging Face config whose defaults may lie past a small vocabulary
# (GPT-2's 50256): speedbench's synthetic tokens have no special tokens.
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
                  "decoder_start_token_id")


def timm_model(name: str, /, **kwargs: Any) -> nn.Module:
    """`timm.create_model(name, pretrained=False, **kwargs)`."""
    import timm

    return timm.create_model(name, pretrained=False, **kwargs)


def torchvision_model(name: str, /, **kwargs: Any) -> nn.Module:
    """`torchvision.models.get_model(name, weights=None, **kwargs)`."""
    import torchvision.models

    return torchvision.models.get_model(name, weights=None, **kwargs)


def hf_model(name: str, /, config: Optional[dict] = None, **kwargs: Any) -> nn.Module:
    """A Hugging Face transformers model from a config, random weights: `name` is a model class
    (`BertForSequenceClassification`: built as cls(cls.config_class(**config))) or an
    `AutoModelFor*` class (config's `model_type` names the architecture:
    AutoConfig.for_model(model_type, **config), then cls.from_config)."""
    import transformers

    cls = getattr(transformers, name, None)
    if cls is None:
        raise ValueError(f"transformers has no {name} (transformers {transformers.__version__})")
    config = dict(config or {})
    if name.startswith("AutoModel"):
        if "model_type" not in config:
            raise ValueError(f"hf: {name} needs config.model_type (bert, gpt2, ...)")
        model_type = config.pop("model_type")
        made = transformers.AutoConfig.for_model(
            model_type, **_small_vocab(transformers.AutoConfig.for_model(model_type), config))
        return cls.from_config(made, **kwargs)
    return cls(cls.config_class(**_small_vocab(cls.config_class(), config)), **kwargs)


def _small_vocab(defaults, config: dict) -> dict:
    """`config` with 0 for each special-token id that the defaults put past its vocab_size and
    that it does not give (transformers warns about such ids on every config it makes)."""
    vocab = config.get("vocab_size")
    out = dict(config)
    for key in SPECIAL_TOKENS:
        value = getattr(defaults, key, None)
        if key not in config and vocab and isinstance(value, int) and value >= vocab:
            out[key] = 0
    return out
