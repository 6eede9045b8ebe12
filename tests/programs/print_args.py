"""A script for `zenflow launch` that prints the arguments it was given."""
import sys

print('ran', sys.argv[1:])
