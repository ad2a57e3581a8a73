"""Hugging Face checkpoints of the Llama family in and out of fibjax (``launch.import_hf``,
``launch.export_hf``): [import_model][fibjax.hf.import_model],
[export_model][fibjax.hf.export_model], [model_config][fibjax.hf.model_config]."""

from fibjax.hf.config import UnsupportedModel, model_config
from fibjax.hf.convert import SOURCE_FILE, export_model, import_model, plan_import

__all__ = ["SOURCE_FILE", "UnsupportedModel", "export_model", "import_model", "model_config", "plan_import"]
