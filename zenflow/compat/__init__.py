"""Names that other libraries' client scripts import."""
