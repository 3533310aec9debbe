class ModelLoadError(ValueError):
  """A model file, package or tensor could not be used; the message says what to do."""
