"""Helpers shared by the test files (no tests here): a test file imports from these modules,
never from another test file."""
