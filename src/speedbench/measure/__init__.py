"""The instrument: a recipe in, one record out. All torch timing lives here."""
