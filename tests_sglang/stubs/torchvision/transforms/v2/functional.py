"""Imported as a module by SGLang's multimodal processors; no name is read at import."""
