"""The base model: where its files are (directory), are they usable (check), loading it (load), what it is (architecture), its experts/."""
