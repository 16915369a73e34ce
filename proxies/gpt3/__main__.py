from proxies.gpt3.proxy import entry

entry()
