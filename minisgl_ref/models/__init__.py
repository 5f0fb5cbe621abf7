"""Model definitions, configs and weight loading (chapter 01)."""

from minisgl_ref.models.config import ModelConfig
from minisgl_ref.models.loader import (MODEL_REGISTRY, ModelPathError, load_model, register_architecture,
                                       resolve_model_path)

__all__ = ["MODEL_REGISTRY", "ModelConfig", "ModelPathError", "load_model", "register_architecture",
           "resolve_model_path"]
