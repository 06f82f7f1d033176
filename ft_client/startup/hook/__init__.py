"""Not a package to import: the directory ft-launcher puts first on a worker's PYTHONPATH.

Its only module, ``sitecustomize``, is what Python imports at start-up (see
`ft_client.startup`). ``__init__.py`` exists so that the directory ships with the
package.
"""
