"""Labs: the notebooks' experiments, one module per notebook. The library never imports them."""
