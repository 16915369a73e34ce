from proxies.resnet.proxy import entry

entry()
