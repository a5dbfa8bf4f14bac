"""The test suite, a package so that ``tests.helpers`` wins over any other ``tests`` on sys.path."""
