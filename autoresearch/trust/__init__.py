"""The checks that keep a proposal honest: allowed paths and contents, the package and data fingerprints,
repeats."""
