"""The leaf of hftatf: what every other package builds on, importing no
other hftatf package."""
