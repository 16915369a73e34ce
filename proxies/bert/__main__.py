from proxies.bert.proxy import entry

entry()
