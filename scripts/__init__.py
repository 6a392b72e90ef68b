"""The repository's scripts, a package so that each imports the others as scripts.<module>."""
