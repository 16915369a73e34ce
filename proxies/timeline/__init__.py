"""python -m proxies timeline TRACE.json -o PICTURE.png: a --trace timeline as a picture
(a few ranks over one iteration, coloured by category; see command.py)."""
