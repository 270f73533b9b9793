"""hpsearch from Python (``import hpsearch``): what search/api/ names."""
