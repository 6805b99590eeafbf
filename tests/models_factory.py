"""Model folders the tests build beyond `pipeline.example`'s families: one that ships its own code."""

import json
import os
import shutil

CONFIG_CODE = '''from transformers import Qwen2Config


class ShippedConfig(Qwen2Config):
    model_type = "shipped_qwen2"
'''
MODEL_CODE = '''from transformers import Qwen2ForCausalLM

from .configuration_shipped import ShippedConfig


class ShippedForCausalLM(Qwen2ForCausalLM):
    config_class = ShippedConfig
'''


def model_with_shipped_code(src: str, dst: str) -> str:
    """A copy of the Qwen2 folder `src` whose config names an architecture transformers does not
    know, defined by Python files in the folder (`auto_map`): it loads only with trust_remote_code."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "configuration_shipped.py"), "w") as f:
        f.write(CONFIG_CODE)
    with open(os.path.join(dst, "modeling_shipped.py"), "w") as f:
        f.write(MODEL_CODE)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(model_type="shipped_qwen2", architectures=["ShippedForCausalLM"],
               auto_map={"AutoConfig": "configuration_shipped.ShippedConfig",
                         "AutoModelForCausalLM": "modeling_shipped.ShippedForCausalLM"})
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
    return dst
