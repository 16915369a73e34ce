from proxies.cosmoflow.proxy import entry

entry()
