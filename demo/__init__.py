"""The README's main job (see __main__.py): an order pipeline against the embedded broker."""
