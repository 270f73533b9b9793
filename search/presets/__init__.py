"""search/presets"""
