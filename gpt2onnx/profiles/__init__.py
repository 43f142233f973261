"""Fusion profiles as plug-ins: one module each, registered in all_profiles (profile: what a profile declares)."""
