"""Test and benchmark support: reference implementations the live code is checked against (nothing in
training imports this package)."""
