from proxies.dlrm.proxy import entry

entry()
