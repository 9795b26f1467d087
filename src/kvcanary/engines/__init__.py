"""Engine adapters and the scripted test engine; each engine's own package is imported lazily."""
